"""Plain op dicts: a fast, exact stand-in for validating ops with the pydantic op models.

A scheduler step is hundreds of small ops; building a model per op costs about a microsecond
each way, more than the bookkeeping itself. ``plain_ops`` accepts exactly the dicts the op
models accept (same keys, strict ints and bools, string ids) and returns them normalised
(every field present, defaults filled in), or None for anything else, which then goes through
the models and gets their errors (``op_dicts``: the whole path, for ``step``). Tests check
the equivalence on random input.

Example: ``[{"op": "extend", "request_id": "a", "num_new_tokens": 1}]`` gives
``[{"op": "extend", "request_id": "a", "num_new_tokens": 1, "lookahead": 0}]``.
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError

from kvcm_client.errors import invalid_from_validation
from kvcm_client.models import CommitOp, ExtendOp, FreeOp, Op, ResumeOp, RewindOp, SuspendOp

#: Per op: (required fields, optional fields with defaults); every field but request_id and
#: token_ids is a strict int (or None where that is the default).
OP_FIELDS: dict[str, tuple[tuple[str, ...], dict[str, int | None]]] = {
    "allocate": (
        ("request_id", "num_tokens"),
        {
            "lookahead": 0,
            "token_ids": None,
            "lora_id": None,
            "cache_salt": None,
            "multimodal": None,
            "block_keys": None,
            "max_new_tokens": None,
        },
    ),
    "extend": (("request_id", "num_new_tokens"), {"lookahead": 0}),
    "rewind": (("request_id", "num_tokens"), {}),
    "commit": (("request_id", "token_ids"), {}),
    "free": (("request_id",), {}),
    "suspend": (("request_id",), {}),
    "resume": (("request_id",), {}),
}
#: Op models without nested models (AllocateOp may hold multimodal models: it is dumped).
_FLAT_OPS = (ExtendOp, RewindOp, CommitOp, FreeOp, SuspendOp, ResumeOp)
_OPS = TypeAdapter(list[Op])
_STEP_KEYS = frozenset({"ops", "atomic", "brief"})
_KEYS = {
    kind: frozenset(("op", *required, *optional))
    for kind, (required, optional) in OP_FIELDS.items()
}


def _plain(op: Any) -> dict[str, Any] | None:
    if type(op) is not dict:
        return None
    kind = op.get("op")
    if kind == "extend":  # the op of every decode step: checked inline
        rid, n, la = op.get("request_id"), op.get("num_new_tokens"), op.get("lookahead", 0)
        # Only these keys: both required ones are present (not None), lookahead maybe.
        if (
            type(rid) is str
            and type(n) is int
            and type(la) is int
            and len(op) == 3 + ("lookahead" in op)
        ):
            return {"op": kind, "request_id": rid, "num_new_tokens": n, "lookahead": la}
        return None
    fields = OP_FIELDS.get(kind) if type(kind) is str else None
    if fields is None or not op.keys() <= _KEYS[kind]:
        return None
    required, optional = fields
    out: dict[str, Any] = {"op": kind}
    for name in required:
        if name not in op:
            return None
        out[name] = op[name]
    for name, default in optional.items():
        out[name] = op.get(name, default)
    for name, value in out.items():
        if name == "op" or name == "request_id":
            if type(value) is not str:
                return None
        elif name == "token_ids":
            if value is None and kind == "allocate":
                continue
            if type(value) is not list or not all(type(t) is int for t in value):
                return None
        elif name == "lora_id":
            if value is not None and type(value) is not int and type(value) is not str:
                return None
        elif name == "cache_salt":
            if value is not None and type(value) is not str:
                return None
        elif name == "max_new_tokens":
            if value is not None and type(value) is not int:
                return None
        elif name in ("multimodal", "block_keys"):
            if value is not None:  # nested models: leave them to the op models
                return None
        elif type(value) is not int:
            return None
    return out


def plain_ops(ops: Any) -> list[dict[str, Any]] | None:
    """The normalised op dicts, or None if the op models would refuse (or change) any op."""
    if type(ops) is not list:
        return None
    out = []
    for op in ops:
        plain = _plain(op)
        if plain is None:
            return None
        out.append(plain)
    return out


def op_dicts(items: list[Any]) -> list[dict[str, Any]]:
    """Ops (models or their dicts) as validated op dicts: ``plain_ops`` when it accepts them,
    the fields of flat op models (validated already), else the models' validation, whose
    errors are ``InvalidArgument``."""
    plain = plain_ops(items)
    if plain is None and all(type(o) in _FLAT_OPS for o in items):
        # Validated frozen models: their fields are already the plain dict.
        plain = [dict(o.__dict__) for o in items]
    if plain is None:
        try:
            models = _OPS.validate_python(items)
        except ValidationError as exc:
            raise invalid_from_validation(exc.errors()) from None
        plain = [m.model_dump() for m in models]
    return plain


def plain_step(body: Any) -> tuple[list[dict[str, Any]], bool, bool] | None:
    """(ops, atomic, brief) of a ``StepRequest`` body, or None if it needs the models."""
    if type(body) is not dict or not body.keys() <= _STEP_KEYS or "ops" not in body:
        return None
    atomic, brief = body.get("atomic", False), body.get("brief", False)
    ops = plain_ops(body["ops"])
    if ops is None or type(atomic) is not bool or type(brief) is not bool:
        return None
    return ops, atomic, brief
