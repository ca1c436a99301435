"""The transfer endpoint's state (``kvcm.transfers`` has the operations): the engine, the
regions it registered, the pulls in flight, the requests lent out and the outcomes of finished
pulls. A component of ``kvcm.components``: its fields change only through its methods."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvcm_client.errors import KVCMError
from kvcm_client.transfer import KVExport, PullState, TransferAgent, TransferRegion

from .transfer_engine import NixlEngine, Xfer

#: Outcomes of finished pulls kept for ``transfer_status`` (the oldest go first).
MAX_OUTCOMES = 4096


@dataclass(slots=True)
class Pull:
    """A pull into row ``row``: its READs, the tokens to commit when they end, and the peer
    to tell."""

    request_id: str
    row: int
    xfers: list[Xfer]
    tokens: list[int]
    peer: str
    notify: bytes
    deadline: float
    blocks: int
    nbytes: int
    cancelled: bool = False
    error: KVCMError | None = None
    done: set[int] = field(default_factory=set)
    #: READs not posted yet (``kvcm.transfers.Piece``): each is posted once the one before
    #: it ended, so that no single post holds the sidecar's loop for long.
    queued: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class Lent:
    """A handed-off request: pinned until its puller's message or ``deadline``."""

    row: int
    export: KVExport
    deadline: float


class Transfers:
    """The transfer endpoint of one manager: the engine, what it registered, the pulls in
    flight, the requests lent out and the outcomes of finished pulls (module docstring)."""

    def __init__(
        self,
        engine: NixlEngine,
        regions: list[TransferRegion],
        state_regions: list[TransferRegion],
        layout: dict[str, Any],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.regions = regions
        self.state_regions = state_regions
        self.layout = layout
        self.clock = clock
        self.pulls: dict[str, Pull] = {}
        self.lent: dict[str, Lent] = {}
        #: notify message -> request id of a lent request.
        self.by_notify: dict[bytes, str] = {}
        self.outcomes: OrderedDict[str, PullState] = OrderedDict()
        #: Outcomes not yet in a step's answer (``take_ended``), oldest first.
        self.ended: deque[PullState] = deque(maxlen=MAX_OUTCOMES)

    @property
    def busy(self) -> bool:
        """Whether a move runs (``poll`` has work)."""
        return bool(self.pulls or self.lent)

    def agent(self, generation: str) -> TransferAgent:
        return TransferAgent(
            name=self.engine.name,
            generation=generation,
            backend="nixl",
            metadata=self.engine.metadata(),
        )

    def lend(self, request_id: str, lent: Lent) -> None:
        self.lent[request_id] = lent
        self.by_notify[lent.export.notify.encode()] = request_id

    def unlend(self, request_id: str) -> Lent:
        lent = self.lent.pop(request_id)
        self.by_notify.pop(lent.export.notify.encode(), None)
        return lent

    def start(self, pull: Pull) -> None:
        self.outcomes.pop(pull.request_id, None)
        self.pulls[pull.request_id] = pull

    def finish(self, request_id: str, outcome: PullState | None) -> Pull:
        """Forget a pull; record its outcome (None: a cancelled pull, which has none)."""
        pull = self.pulls.pop(request_id)
        if outcome is not None:
            self.record(outcome)
        return pull

    def record(self, outcome: PullState) -> None:
        """Keep a finished pull's outcome for ``transfer_status`` (the last MAX_OUTCOMES)."""
        self.outcomes.pop(outcome.request_id, None)
        self.outcomes[outcome.request_id] = outcome
        while len(self.outcomes) > MAX_OUTCOMES:
            self.outcomes.popitem(last=False)
        self.ended.append(outcome)

    def take_ended(self) -> list[PullState]:
        """The outcomes recorded since the last call (what a step's answer carries)."""
        out = list(self.ended)
        self.ended.clear()
        return out

    def close(self) -> None:
        self.engine.close()
