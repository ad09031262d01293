"""A small language model with BatchNorm (running statistics and a batch
count: buffers), scripted with torch.jit.script in training mode and saved
to the path given, for the tests of buffers (issue 18, item 3).

Usage: python batchnorm_lm.py PATH [SEED]
Prints the names of the model's state_dict as a JSON list."""
import json
import sys

import torch
from torch import nn


class BatchNormLM(nn.Module):
    """Token and position embeddings, BatchNorm over the features, a head."""

    def __init__(self, vocab: int = 11, seq: int = 8, d: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.bn = nn.BatchNorm1d(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok(tokens) + self.pos(positions)
        return self.head(self.bn(h.transpose(1, 2)).transpose(1, 2))


if __name__ == "__main__":
    torch.manual_seed(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    model = BatchNormLM()
    torch.jit.script(model).save(sys.argv[1])
    print(json.dumps(list(model.state_dict())))
