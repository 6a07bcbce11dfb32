"""The demo's data and model: Python's own standard library, read one character at a time.

Every machine with Python has the text: the ``.py`` files of the standard library directory.
Files are taken in sorted order and every tenth one is held out for validation, so the split
is the same on every rank and every run. The vocabulary is printable ASCII plus tab and newline;
anything else reads as ``?``.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

__all__ = ["GPT", "BlockDataset", "Corpus", "GPTConfig", "Vocab", "load_corpus"]

VALIDATION_EVERY = 10  # file i is held out when i % 10 == 9


class Vocab:
    """Character vocabulary: tab, newline and printable ASCII; every other character is ``?``."""

    def __init__(self) -> None:
        self.chars = ["\t", "\n"] + [chr(c) for c in range(32, 127)]
        unknown = self.chars.index("?")
        # byte -> token id, for encoding megabytes at once with a single gather.
        self._table = torch.full((256,), unknown, dtype=torch.long)
        for token, char in enumerate(self.chars):
            self._table[ord(char)] = token

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        raw = text.encode("ascii", errors="replace")
        return self._table[torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()]

    def decode(self, tokens: torch.Tensor | list[int]) -> str:
        return "".join(self.chars[int(t)] for t in tokens)


class Corpus:
    """The training and validation text and the files each came from."""

    def __init__(self, root: Path, train_files: list[Path], val_files: list[Path]) -> None:
        self.root, self.train_files, self.val_files = root, train_files, val_files

    @staticmethod
    def _read(files: list[Path]) -> str:
        return "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)

    def train_text(self) -> str:
        return self._read(self.train_files)

    def val_text(self) -> str:
        return self._read(self.val_files)


def load_corpus(max_files: int | None = None, root: str | Path | None = None) -> Corpus:
    """The standard library's top-level ``.py`` files, split by file into train and validation.

    Args:
        max_files: use only the first this many files (sorted by name), for quick runs.
        root: the directory to read; by default this Python's standard library.

    Raises:
        RuntimeError: the directory holds too few ``.py`` files to split.
    """
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    found = sorted(base.glob("*.py"))
    files = found[:max_files]
    if len(files) < VALIDATION_EVERY:
        if len(files) < len(found):
            raise RuntimeError(
                f"--max-files {max_files} keeps {len(files)} of the {len(found)} .py files in "
                f"{base}; the demo needs at least {VALIDATION_EVERY}: raise --max-files")
        raise RuntimeError(
            f"{base} holds {len(files)} .py files, the demo needs at least {VALIDATION_EVERY} "
            "(check that the standard library's sources are installed)"
        )
    val = [f for i, f in enumerate(files) if i % VALIDATION_EVERY == VALIDATION_EVERY - 1]
    train = [f for i, f in enumerate(files) if i % VALIDATION_EVERY != VALIDATION_EVERY - 1]
    return Corpus(base, train, val)


class BlockDataset(Dataset):
    """Non-overlapping blocks of a token stream: item ``i`` is (block ``i``, block ``i`` shifted by one)."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class GPTConfig:
    """Sizes of the model."""

    def __init__(
        self, vocab_size: int, block_size: int = 128, n_layer: int = 4, n_head: int = 4,
        n_embd: int = 128, dropout: float = 0.0,
    ) -> None:
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be a multiple of n_head={n_head}")
        self.vocab_size, self.block_size = vocab_size, block_size
        self.n_layer, self.n_head, self.n_embd, self.dropout = n_layer, n_head, n_embd, dropout


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        # [batch, time, channels] -> [batch, heads, time, head_dim]
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, channels))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small decoder-only transformer over characters (token and position embeddings tied to the head)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.Sequential(*(Block(cfg) for _ in range(cfg.n_layer)))
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # weight tying: fewer parameters, faster learning
        self.apply(self._init)
        # GPT-2's scaled init of residual projections keeps the residual stream's variance flat.
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, time, vocab]`` for token ids ``[batch, time]``."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        return self.head(self.ln(self.blocks(x)))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 0.8) -> torch.Tensor:
        """Continue ``idx`` ``[1, time]`` by sampling ``new_tokens`` characters."""
        for _ in range(new_tokens):
            logits = self(idx[:, -self.cfg.block_size :])[:, -1] / temperature
            idx = torch.cat([idx, torch.multinomial(logits.softmax(-1), 1)], dim=1)
        return idx
