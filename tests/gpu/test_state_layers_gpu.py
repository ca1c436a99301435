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


def test_the_toy_recurrence_through_kvcm_on_cuda_equals_it_without() -> None:
    model = ToyRecurrence()
    model.emb, model.w = model.emb.cuda(), model.w.cuda()
    m = KVCacheManager(
        {
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
    )
    conv, ssm = m.state_view(1, "conv"), m.state_view(1, "ssm")
    assert conv.is_cuda and ssm.is_cuda

    def reference(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        c, s = torch.zeros(4, 2, device="cuda"), torch.zeros(4, 4, device="cuda")
        model.run(c, s, tokens)
        return c, s

    prompt = list(range(300, 321))
    hits = []
    for rid, tail in (("a", []), ("b", [7]), ("c", [7, 8, 9, 10])):
        tokens = prompt + tail
        info = m.allocate(rid, len(tokens), token_ids=tokens)
        for start in range(info.num_hit_tokens, len(tokens), TPB):
            chunk = tokens[start : start + TPB]
            model.run(conv[info.row], ssm[info.row], chunk)
            m.commit(rid, chunk)
        want = reference(tokens)
        assert torch.equal(conv[info.row], want[0]) and torch.equal(ssm[info.row], want[1])
        hits.append(info.num_hit_tokens)
    assert hits == [0, 20, 20]
    assert m.state_indices(["a", "c"]).tolist() == [m.request("a").row, m.request("c").row]
