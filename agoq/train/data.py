"""Training data: a corpus as one token stream, its 90/10 train/validation split, and batches by position.

Tokenizers: bytes (every byte is a token, vocabulary 256; a stream of bytes needs no special tokens,
so any model with a vocabulary of at least 256 fits), or a HuggingFace `tokenizers` JSON file.
Without a data file, a built-in synthetic corpus is generated (deterministic, nothing downloaded).

Batches are a pure function of their position: the sequence with global index g is window
`perm_e[g mod W]` of the training split, where W windows of seq_len + 1 tokens tile the split and
`perm_e` is a seeded permutation for epoch e = g div W. Step s, micro-batch m, data-parallel rank r
and row i read g = s*G + m*(B*R) + r*B + i (G = B*R*accumulation, B the micro-batch, R the ranks), so
a run resumed at step s reads exactly what an uninterrupted one would, and R ranks together read
what one process with R times the micro-batch would.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

BYTE_VOCAB = 256
VAL_FRACTION = 0.1
SYNTHETIC_BYTES = 1_000_000


@functools.lru_cache(maxsize=2)
def synthetic_text(num_bytes: int = SYNTHETIC_BYTES, seed: int = 1234) -> bytes:
    """Deterministic English-like text: sentences of pseudo-words from a sparse random bigram chain.

    Each of 400 pseudo-words has 6 likely successors, so a model can learn it well below the 8 bits
    per byte of random bytes, yet it never repeats verbatim. Made once per process (0.1 s; `agoq profile`
    prepares 68 runs on it) and kept: bytes cannot change.
    """
    g = torch.Generator().manual_seed(seed)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    weights = torch.tensor([12.0, 9.1, 8.2, 7.5, 7.0, 6.7, 6.3, 6.1, 6.0, 4.3, 4.0, 2.8, 2.8, 2.4, 2.4, 2.2, 2.0,
                            2.0, 1.9, 1.5, 1.0, 0.8, 0.2, 0.2, 0.1, 0.1])
    num_words = 400
    lengths = torch.randint(1, 9, (num_words,), generator=g)
    words = []
    for n in lengths.tolist():
        idx = torch.multinomial(weights, n, replacement=True, generator=g).tolist()
        words.append("".join(letters[i] for i in idx))
    successors = torch.randint(0, num_words, (num_words, 6), generator=g).tolist()
    succ_p = torch.tensor([0.4, 0.2, 0.15, 0.1, 0.1, 0.05])
    out, size, word = [], 0, 0
    sentence_len = 0
    choices = torch.multinomial(succ_p, num_bytes, replacement=True, generator=g).tolist()
    stops = (torch.rand(num_bytes, generator=g) < 0.08).tolist()
    k = 0
    while size < num_bytes:
        w = words[word]
        if sentence_len == 0:
            w = w.capitalize()
        sentence_len += 1
        if stops[k % num_bytes] and sentence_len > 3:
            piece, sentence_len = w + ".\n" if k % 5 == 0 else w + ". ", 0
        else:
            piece = w + " "
        out.append(piece)
        size += len(piece)
        word = successors[word][choices[k % num_bytes]]
        k += 1
    return "".join(out).encode()[:num_bytes]


@dataclass
class Corpus:
    """A token stream, split into training and validation parts, with what made it."""

    train: torch.Tensor  # int64 [n_train]
    val: torch.Tensor  # int64 [n_val]
    vocab_size: int
    tokenizer: str  # "bytes" or the tokenizers JSON path
    source: str  # the data file, or "synthetic"
    sha256: str  # of the raw data


def _split(tokens: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    n_val = int(round(tokens.numel() * val_fraction))
    return tokens[: tokens.numel() - n_val], tokens[tokens.numel() - n_val:]


def load_corpus(data: str | None, tokenizer: str | None = None, val_fraction: float = VAL_FRACTION) -> Corpus:
    """Read and tokenize `data` (a text file; None: the synthetic corpus), split 90/10 into train/validation.

    Raises FileNotFoundError for a missing data or tokenizer file, ValueError for an empty data file or a
    tokenizer file that is no tokenizers JSON.
    """
    if data is None:
        raw, source = synthetic_text(), "synthetic"
    else:
        path = Path(data)
        if path.is_dir():
            raise ValueError(f"--data {path} is a folder: give one text file")
        if not path.is_file():
            raise FileNotFoundError(f"data file not found: {path} (give a text file with --data, or leave --data out "
                                    "to train on the built-in synthetic corpus)")
        raw, source = path.read_bytes(), str(path)
        if not raw:
            raise ValueError(f"data file {path} is empty")
    digest = hashlib.sha256(raw).hexdigest()
    if tokenizer is None:
        tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)
        vocab, name = BYTE_VOCAB, "bytes"
    else:
        tok_path = Path(tokenizer)
        if tok_path.is_dir():
            raise ValueError(f"--tokenizer {tok_path} is a folder: give its tokenizer.json")
        if not tok_path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {tok_path} (a HuggingFace tokenizers JSON)")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError("--tokenizer needs the `tokenizers` package (pip install tokenizers); "
                             "leave --tokenizer out to use bytes") from None
        try:
            tok = Tokenizer.from_file(str(tok_path))
        except Exception as e:  # the tokenizers package raises a bare Exception for a file it cannot parse
            raise ValueError(f"--tokenizer {tok_path} is not a HuggingFace tokenizers JSON file ({e}): give the "
                             "tokenizer.json of a model, or leave --tokenizer out to use bytes") from None
        ids = tok.encode(raw.decode("utf-8", errors="replace")).ids
        tokens = torch.tensor(ids, dtype=torch.int64)
        vocab, name = tok.get_vocab_size(), str(tok_path)
    train, val = _split(tokens, val_fraction)
    return Corpus(train, val, vocab, name, source, digest)


@dataclass(frozen=True)
class BatchShape:
    """The batch shape of a run: tokens per sequence, sequences per micro-batch (and rank), micro-batches per
    optimizer step (with a pipeline: the 1F1B schedule's)."""

    seq_len: int
    micro_batch: int
    grad_accum: int


class Batches:
    """Micro-batches of (input_ids, labels) [B, seq_len] by position (see the module docstring)."""

    def __init__(self, corpus: Corpus, seq_len: int, micro_batch: int, grad_accum: int, data_ranks: int, seed: int):
        self.seq_len, self.micro_batch, self.grad_accum, self.data_ranks = seq_len, micro_batch, grad_accum, data_ranks
        self.seed = seed
        self.val_rows = micro_batch  # validation micro-batch size (kept when a pipeline stacks micro-batches)
        self.tokens = corpus.train
        self.windows = (self.tokens.numel() - 1) // seq_len
        if self.windows < 1:
            raise ValueError(f"the training split has {self.tokens.numel()} tokens, fewer than one sequence of "
                             f"--seq-len {seq_len} + 1: use a larger data file or a shorter --seq-len")
        self.val_tokens = corpus.val
        self.val_windows = (self.val_tokens.numel() - 1) // seq_len
        if self.val_windows < 1:
            raise ValueError(f"the validation split has {self.val_tokens.numel()} tokens, fewer than one sequence "
                             f"of --seq-len {seq_len} + 1: use a larger data file or a shorter --seq-len")
        self._perm_epoch, self._perm = -1, None

    @property
    def sequences_per_step(self) -> int:
        """Sequences one optimizer step reads over all data-parallel ranks."""
        return self.micro_batch * self.data_ranks * self.grad_accum

    def _window(self, g: int) -> int:
        epoch, i = divmod(g, self.windows)
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.windows, generator=gen), epoch
        return int(self._perm[i])

    def _rows(self, tokens: torch.Tensor, windows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = torch.stack([tokens[w * self.seq_len: w * self.seq_len + self.seq_len + 1] for w in windows])
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()

    def micro(self, step: int, micro: int, rank: int = 0, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels) of micro-batch `micro` of optimizer step `step` (0-based) for data rank `rank`.

        `rows` (default: the micro-batch) reads that many consecutive sequences instead.
        """
        first = step * self.sequences_per_step + micro * self.micro_batch * self.data_ranks + rank * self.micro_batch
        return self._rows(self.tokens, [self._window(first + i) for i in range(rows or self.micro_batch)])

    def step_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All micro-batches of one step for one rank, stacked: [grad_accum * micro_batch, seq_len] (pipelines)."""
        parts = [self.micro(step, m) for m in range(self.grad_accum)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def validation(self, max_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The fixed validation micro-batches: the first windows of the validation split, in order."""
        n = min(self.val_windows, max_batches * self.val_rows)
        out = []
        for start in range(0, n, self.val_rows):
            out.append(self._rows(self.val_tokens, list(range(start, min(n, start + self.val_rows)))))
        return out
