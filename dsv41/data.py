"""Training data: memory-mapped token files packed into [B, S] batches, and synthetic long-context tasks.

A batch is {"inputs": int32 [B, S], "targets": int32 [B, S], "loss_mask": float32 [B, S]}: targets are
the inputs shifted by one, and the mask is 1 where the target token is trained on.
- Prompt/response data (the synthetic tasks, CED-style examples): only response tokens are targets;
  the prompt is what the encoder compresses and the decoder reads through the global KV (DESIGN §3.5).
- Pretraining token files: the stream is cut into consecutive windows of S + 1 tokens (packing
  documents end to end; the model has no document ids, so attention crosses document boundaries as in
  plain GPT packing). Split rule: the first `prompt_tokens` positions of every window are prompt (no
  loss), the rest response; the default 0 trains on every token, since the full forward runs every
  layer at every position.
Every source is deterministic given its seed and restartable from `state()` (a small JSON dict).
Token ids are bytes (vocab 256) for the synthetic tasks, as configs/tiny.json and small.json use.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

FILLER = (b"The grass is green. The sky is blue. The sun is yellow. Here we go. "
          b"There and back again. ")
TASKS = ("passkey", "kv_recall")


def _batch(rows: np.ndarray, masks: np.ndarray) -> dict:
    """rows int [B, S+1], masks [B, S+1] (1 = response token) -> the batch dict."""
    return {"inputs": rows[:, :-1].astype(np.int32), "targets": rows[:, 1:].astype(np.int32),
            "loss_mask": masks[:, 1:].astype(np.float32)}


def load_tokens(path: str | Path, dtype: str | None = None) -> np.ndarray:
    """A 1-D memory-mapped token array: `.npy` (its own dtype) or raw `.bin` (dtype required)."""
    path = Path(path)
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
    elif path.suffix == ".bin":
        if dtype is None:
            raise ValueError(f"dtype: None for {path}: expected the token dtype of a raw .bin file (e.g. uint16)")
        tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    else:
        raise ValueError(f"path: {str(path)!r}: expected a .npy or .bin token file")
    if tokens.ndim != 1:
        raise ValueError(f"{path}: shape {tokens.shape}: expected a 1-D token stream")
    return tokens


class PackedTokens:
    """Batches of consecutive (S + 1)-token windows of a token stream, in a seeded order per epoch.

    The window order of epoch e is a permutation drawn from (seed, e); the state is (epoch, cursor).
    """

    def __init__(self, tokens: np.ndarray, batch: int, seq: int, seed: int = 0, prompt_tokens: int = 0,
                 vocab_size: int | None = None):
        self.tokens, self.batch, self.seq, self.seed = tokens, batch, seq, seed
        self.windows = (len(tokens) - 1) // seq  # window w covers tokens [w·S, w·S + S] (S + 1 tokens)
        if self.windows < batch:
            raise ValueError(f"tokens: {len(tokens)} tokens: expected at least batch·seq + 1 = {batch * seq + 1}")
        if not 0 <= prompt_tokens < seq:
            raise ValueError(f"prompt_tokens: {prompt_tokens}: expected 0 <= prompt_tokens < seq ({seq})")
        self.prompt_tokens, self.vocab_size = prompt_tokens, vocab_size
        self.epoch, self.cursor = 0, 0

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def restore(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.windows)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.cursor + self.batch > self.windows:  # drop the epoch's remainder: every batch is full
            self.epoch, self.cursor = self.epoch + 1, 0
        picks = self._order(self.epoch)[self.cursor:self.cursor + self.batch]
        self.cursor += self.batch
        rows = np.stack([np.asarray(self.tokens[w * self.seq: w * self.seq + self.seq + 1]) for w in picks])
        if self.vocab_size is not None and (rows.min() < 0 or rows.max() >= self.vocab_size):
            raise ValueError(f"tokens: ids in [{rows.min()}, {rows.max()}]: expected 0..{self.vocab_size - 1}")
        masks = np.ones_like(rows, np.float32)
        masks[:, :self.prompt_tokens + 1] = 0  # target t is token t + 1: prompt targets are 1..prompt_tokens
        return _batch(rows.astype(np.int64), masks)


def _fit(prompt_parts: list[bytes], answer: bytes, length: int, depth: float, rng) -> tuple[bytes, bytes]:
    """(prompt, answer) of `length` bytes: filler with `prompt_parts[0]` (the needle) at `depth` ∈ [0, 1]
    of the filler, then `prompt_parts[1]` (the question), then the answer."""
    needle, question = prompt_parts
    room = length - len(needle) - len(question) - len(answer)
    if room < 0:
        raise ValueError(f"seq: {length - 1}: expected at least {len(needle) + len(question) + len(answer) - 1} "
                         "tokens to hold the needle, the question and the answer")
    start = int(rng.integers(len(FILLER)))  # a random phase, so the needle is not always at a sentence start
    filler = (FILLER * (room // len(FILLER) + 2))[start:start + room]
    at = int(round(depth * room))
    return filler[:at] + needle + filler[at:] + question, answer


PASSKEY_NEEDLE = (b" The pass key is ", b". Remember it. ")  # the key goes between the two
PASSKEY_QUESTION = b" What is the pass key? The pass key is "


def passkey_min_length(digits: int = 5) -> int:
    """The fewest bytes (prompt + answer) a passkey example holds: needle, question and answer, no filler."""
    return sum(map(len, PASSKEY_NEEDLE)) + len(PASSKEY_QUESTION) + 2 * digits


def passkey_example(length: int, depth: float, rng, digits: int = 5) -> tuple[bytes, bytes]:
    """A passkey retrieval example of `length` bytes: (prompt, answer digits)."""
    key = "".join(str(d) for d in rng.integers(0, 10, digits)).encode()
    return _fit([PASSKEY_NEEDLE[0] + key + PASSKEY_NEEDLE[1], PASSKEY_QUESTION], key, length, depth, rng)


def kv_recall_example(length: int, depth: float, rng, pairs: int = 4) -> tuple[bytes, bytes]:
    """Multi-key key-value recall: `pairs` "key=value" pairs at `depth`, then one key is asked."""
    keys = [bytes(rng.choice(list(b"abcdefghijklmnopqrstuvwxyz"), 4).tolist()) for _ in range(pairs)]
    values = ["".join(str(d) for d in rng.integers(0, 10, 4)).encode() for _ in range(pairs)]
    asked = int(rng.integers(pairs))
    table = b" " + b"; ".join(k + b"=" + v for k, v in zip(keys, values)) + b". "
    return _fit([table, b" What is " + keys[asked] + b"? " + keys[asked] + b"="], values[asked], length, depth, rng)


class Synthetic:
    """Batches of a synthetic task, example i drawn from (seed, i): the state is the next example index.

    depth: a fixed needle depth in [0, 1], or None for a uniform random depth per example.
    prompt_weight: the `loss_mask` of the prompt tokens (the answer's is 1). 0 trains on the answer only;
    a small weight adds next-token prediction on the filler text (for the passkey model it changed
    little: held-out exact match 1.0 by step 600 with 0.2, by step 750 with 0, both at lr 1e-3).
    """

    def __init__(self, task: str, batch: int, seq: int, seed: int = 0, depth: float | None = None,
                 key_digits: int = 5, prompt_weight: float = 0.0):
        if task not in TASKS:
            raise ValueError(f"task: {task!r}: expected one of {TASKS}")
        if key_digits < 1:
            raise ValueError(f"key_digits: {key_digits}: expected at least 1")
        if depth is not None and not 0 <= depth <= 1:
            raise ValueError(f"depth: {depth}: expected a fraction in [0, 1] or None")
        if not 0 <= prompt_weight <= 1:
            raise ValueError(f"prompt_weight: {prompt_weight}: expected a loss weight in [0, 1]")
        self.prompt_weight = float(prompt_weight)
        self.task, self.batch, self.seq, self.seed, self.depth = task, batch, seq, seed, depth
        self.key_digits = key_digits  # passkey: digits per key (longer keys: more retrieval targets per row)
        self.index = 0
        self.example(0)  # refuses a seq too short for the task now, not at the first batch

    def state(self) -> dict:
        return {"index": self.index}

    def restore(self, state: dict) -> None:
        self.index = int(state["index"])

    def example(self, i: int) -> tuple[bytes, bytes]:
        rng = np.random.default_rng([self.seed, i])
        depth = float(rng.uniform()) if self.depth is None else self.depth
        if self.task == "passkey":
            return passkey_example(self.seq + 1, depth, rng, self.key_digits)
        return kv_recall_example(self.seq + 1, depth, rng)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        rows, masks = [], []
        for i in range(self.index, self.index + self.batch):
            prompt, answer = self.example(i)
            rows.append(np.frombuffer(prompt + answer, np.uint8))
            masks.append(np.r_[np.full(len(prompt), self.prompt_weight), np.ones(len(answer))])
        self.index += self.batch
        return _batch(np.stack(rows).astype(np.int64), np.stack(masks))
