"""State layers on CUDA: the state pools, checkpoints and restores on the device, and the toy
recurrence run through kvcm's state views equal to the same recurrence run without kvcm on
the same device (tests/test_state_layers.py has the CPU version)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: GPU tests run on the GPU machine only", allow_module_level=True)

from state_consumer import ToyRecurrence

from kvcm import KVCacheManager

TPB = 4


def _manager(**kw: object) -> KVCacheManager:
    cfg: dict[str, object] = {
        "layers": [{"layer_id": 0, "num_kv_heads": 1, "head_dim": 8, "dtype": "fp32"}],
        "state_layers": [
            {
                "layer_id": 1,
                "buffers": [
                    {"name": "conv", "shape": [4, 2], "dtype": "fp32"},
                    {"name": "ssm", "shape": [4, 4], "dtype": "fp32"},
                ],
            }
        ],
        "tokens_per_block": TPB,
        "num_blocks": 64,
        "max_requests": 4,
        "max_seq_len": 64,
        "device": "cuda:0",
    }
    cfg.update(kw)
    return KVCacheManager(cfg)


def _model() -> ToyRecurrence:
    model = ToyRecurrence()
    model.emb, model.w = model.emb.cuda(), model.w.cuda()
    return model


def _reference(model: ToyRecurrence, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    c, s = torch.zeros(4, 2, device="cuda"), torch.zeros(4, 4, device="cuda")
    model.run(c, s, tokens)
    return c, s


def test_the_toy_recurrence_through_kvcm_on_cuda_equals_it_without() -> None:
    model = _model()
    m = _manager()
    conv, ssm = m.state_view(1, "conv"), m.state_view(1, "ssm")
    assert conv.is_cuda and ssm.is_cuda

    prompt = list(range(300, 321))
    hits = []
    for rid, tail in (("a", []), ("b", [7]), ("c", [7, 8, 9, 10])):
        tokens = prompt + tail
        info = m.allocate(rid, len(tokens), token_ids=tokens)
        for start in range(info.num_hit_tokens, len(tokens), TPB):
            chunk = tokens[start : start + TPB]
            model.run(conv[info.row], ssm[info.row], chunk)
            m.commit(rid, chunk)
        want = _reference(model, tokens)
        assert torch.equal(conv[info.row], want[0]) and torch.equal(ssm[info.row], want[1])
        hits.append(info.num_hit_tokens)
    assert hits == [0, 20, 20]
    assert m.state_indices(["a", "c"]).tolist() == [m.request("a").row, m.request("c").row]


def test_a_suspended_state_goes_to_pinned_host_memory_and_back_on_cuda() -> None:
    """Prefill "a", suspend it (its state to the pinned host tier, on the tier's stream),
    fill the device with two requests (one in a's old live slot), resume "a" into the other
    slot, decode: the states equal the recurrence run without kvcm."""
    model = _model()
    m = _manager(num_blocks=12, state_live_slots=2, host_memory_bytes=1 << 14)
    conv, ssm = m.state_view(1, "conv"), m.state_view(1, "ssm")

    def prefill(rid: str, prompt: list[int]) -> None:
        info = m.allocate(rid, len(prompt), token_ids=prompt)
        for start in range(info.num_hit_tokens, len(prompt), TPB):
            chunk = prompt[start : start + TPB]
            model.run(conv[info.state_slot], ssm[info.state_slot], chunk)
            m.commit(rid, chunk)

    def check(rid: str, tokens: list[int]) -> None:
        slot = m.request(rid).state_slot
        want = _reference(model, tokens)
        assert torch.equal(conv[slot], want[0]) and torch.equal(ssm[slot], want[1]), rid

    prompt = list(range(100, 113))
    prefill("a", prompt)
    m.suspend("a")
    prefill("x", list(range(200, 224)))
    prefill("y", list(range(300, 324)))
    assert m.state_indices(["x", "y"]).tolist() == [1, 0]
    m.free("x")
    assert m.resume("a").state_slot == 1
    for t in (5, 6, 7):
        m.extend("a", 1)
        model.run(conv[1], ssm[1], [t])
        m.commit("a", [t])
    check("a", [*prompt, 5, 6, 7])
    check("y", list(range(300, 324)))
    assert m.host_stats()["offloaded_states"] == m.host_stats()["onboarded_states"] == 1
