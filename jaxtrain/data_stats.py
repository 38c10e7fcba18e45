"""`python -m jaxtrain.data stats`: a token folder's counts, and the entropies a model's loss should beat."""

import sys

import numpy as np

MAX_TOKENS = 2**24  # a prefix this long estimates the entropies well and keeps memory under ~1 GB


def entropies(tokens: np.ndarray, vocab_size: int) -> tuple[float, float]:
    """(unigram entropy H(x_t), bigram conditional entropy H(x_t | x_t-1)) of a token stream, in nats.

    The cross-entropy of the best model that knows only token frequencies, and only the previous token: the
    yardsticks a trained model's loss should beat.
    """
    t = np.asarray(tokens, dtype=np.int64)
    _, pair_counts = np.unique(t[:-1] * vocab_size + t[1:], return_counts=True)
    conditional = _entropy(pair_counts) - _entropy(np.bincount(t[:-1], minlength=vocab_size))
    return _entropy(np.bincount(t, minlength=vocab_size)), conditional


def _entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def print_stats(data) -> None:
    """`python -m jaxtrain.data stats` of `data` (a data.TokenData)."""
    sample = data.train[:MAX_TOKENS]
    h1, h2 = entropies(sample, data.vocab_size)
    over = f" (first {len(sample):,} tokens)" if len(sample) < len(data.train) else ""
    print(f"data: {data.path}\ntokenizer: {data.tokenizer}, vocab_size {data.vocab_size}\n"
          f"train: {len(data.train):,} tokens, val: {len(data.val):,} tokens\n"
          f"train unigram entropy H(x_t): {h1:.3f} nats{over}\n"
          f"train bigram conditional entropy H(x_t | x_t-1): {h2:.3f} nats{over}\n"
          f"(the loss of the best model that sees only token frequencies / only the previous token)")


def warn_small_val(data, cfg) -> None:
    """On stderr, where an evaluation of `cfg` (a Config) reads more tokens than `data`'s val split (a
    data.TokenData's) holds: every evaluation then scores the same tokens over again (its windows start anywhere,
    drawn with replacement, so they overlap at any size; past the split's size, by more than the split), a loss of a
    split that may say little of any other text, at more cost than it learns from. Both backends, once every
    start-up check has passed."""
    t, n_val = cfg.train, len(data.val)
    window = cfg.data.batch_size * cfg.model.seq_len  # tokens an eval batch reads
    reads = t.eval_batches * window
    if n_val < reads:
        fits = n_val // window
        fix = (f"train.eval_batches={fits} reads no more than it holds, or prepare a larger val split "
               f"(--val-fraction)" if fits else "prepare a larger val split (--val-fraction)")
        print(f"warning: an evaluation reads {reads:,} tokens (train.eval_batches={t.eval_batches} x "
              f"data.batch_size={cfg.data.batch_size} windows of model.seq_len={cfg.model.seq_len}), more than the "
              f"{n_val:,} that the val split of {data.path} holds: each is read {reads / n_val:.1f} times on "
              f"average, and the val loss is of those {n_val:,} tokens alone; {fix}", file=sys.stderr)
