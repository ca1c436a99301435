"""A reference consumer of state layers: a toy Mamba-like recurrence run on kvcm's state
views, in process or in a process of its own (``python tests/state_consumer.py``: it reads
a ``SharedLayout`` as JSON on its first line, attaches, then runs one ``slot token...`` line
at a time on that live state slot and answers ``ok``)."""

from __future__ import annotations

import sys

import torch


class ToyRecurrence:
    """A causal convolution over the last k inputs, then a decaying outer-product state:
    ``run`` advances a (conv ``[d, k - 1]``, ssm ``[d, d]``) state over tokens, in place."""

    def __init__(self, d: int = 4, k: int = 3, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.d, self.k = d, k
        self.emb = torch.randn(1000, d, generator=g)
        self.w = torch.randn(d, k, generator=g)

    def run(self, conv: torch.Tensor, ssm: torch.Tensor, tokens: list[int]) -> None:
        for t in tokens:
            window = torch.cat([conv, self.emb[t][:, None].to(conv.device)], dim=1)
            u = (window * self.w.to(conv.device)).sum(1)
            ssm.mul_(0.9).add_(torch.outer(u, u))
            conv.copy_(window[:, 1:])

    def reference(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The state after ``tokens`` from zeros, without kvcm."""
        conv, ssm = torch.zeros(self.d, self.k - 1), torch.zeros(self.d, self.d)
        self.run(conv, ssm, tokens)
        return conv, ssm


def main() -> None:
    from kvcm_client import attach
    from kvcm_client.models import SharedLayout

    layout = SharedLayout.model_validate_json(sys.stdin.readline())
    model = ToyRecurrence()
    with attach(layout) as att:
        conv, ssm = att.state_view(1, "conv"), att.state_view(1, "ssm")
        print("attached", flush=True)
        for line in sys.stdin:
            slot, *tokens = (int(v) for v in line.split())
            model.run(conv[slot], ssm[slot], tokens)
            print("ok", flush=True)


if __name__ == "__main__":
    main()
