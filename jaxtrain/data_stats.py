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
    """On stderr, where `data`'s val split (a data.TokenData's) holds fewer tokens than an evaluation of `cfg` (a
    Config) reads: its windows then overlap, and every evaluation scores the same few tokens again, a loss that
    says little of any other text. Both backends, once every start-up check has passed."""
    t = cfg.train
    reads = t.eval_batches * cfg.data.batch_size * cfg.model.seq_len
    if len(data.val) < reads:
        print(f"warning: the val split of {data.path} holds {len(data.val):,} tokens, fewer than an evaluation reads "
              f"(train.eval_batches={t.eval_batches} x data.batch_size={cfg.data.batch_size} windows of "
              f"model.seq_len={cfg.model.seq_len}: {reads:,} tokens): its windows overlap, so the val loss is of "
              f"those {len(data.val):,} tokens alone; prepare the data with a larger --val-fraction, or lower "
              f"train.eval_batches", file=sys.stderr)
