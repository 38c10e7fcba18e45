"""Either backend's real run with a NaN injected into chosen windows, the same windows in both:

    python -m parity_tests.inject_nan jaxtrain|torchref STEPS [--config ... --section.key=value ...]

STEPS: comma-separated 1-based optimizer steps. The model's forward is wrapped so that the first micro-batch of
each chosen window (recognised by its tokens: batches are a pure function of the data, seed and step) yields NaN
logits, hence a NaN loss and NaN gradients; every other batch, evaluation included, is untouched. A test tool: it
needs what the fault needs and nothing else, so both backends meet the same fault at the same step.
"""

import numpy as np

from jaxtrain import config, data
from jaxtrain.cmdline import positive_int
from jaxtrain.errors import OneLineParser, exit_on_user_error


def poisoned_inputs(argv: list[str], steps: list[int]) -> list[np.ndarray]:
    """The first micro-batch (B/k, T) of each chosen window, as the run will draw it (a fresh run: run.seed)."""
    cfg = config.load(argv)
    tokens = data.load(cfg.data, cfg.model.seq_len)
    return [data.window(tokens, seed=cfg.run.seed, step=s - 1, batch_size=cfg.data.batch_size,
                        accum_steps=cfg.optim.grad_accum_steps, seq_len=cfg.model.seq_len)[0][0] for s in steps]


def poison_jaxtrain(bad: list[np.ndarray]) -> None:
    import jax.numpy as jnp
    from jaxtrain import model

    clean = model.apply

    def apply(graphdef, params, idx_BxT, *, dropout_key=None):
        logits = clean(graphdef, params, idx_BxT, dropout_key=dropout_key)
        hit = jnp.any(jnp.array([jnp.array_equal(idx_BxT, b) for b in bad if b.shape == idx_BxT.shape] or [False]))
        return logits + jnp.where(hit, jnp.nan, 0.0)

    model.apply = apply


def poison_torchref(bad: list[np.ndarray]) -> None:
    from torchref import model

    clean = model.GPT.forward

    def forward(self, idx):
        logits = clean(self, idx)
        hit = any(b.shape == tuple(idx.shape) and np.array_equal(idx.cpu().numpy(), b) for b in bad)
        return logits + float("nan") if hit else logits

    model.GPT.forward = forward


def _steps(text: str) -> list[int]:
    return [positive_int(s) for s in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    ap = OneLineParser(prog="python -m parity_tests.inject_nan", description=__doc__.split("\n\n")[0],
                       epilog="Any further --config/--section.key=value flags go to the run.")
    ap.add_argument("backend", choices=("jaxtrain", "torchref"))
    ap.add_argument("steps", type=_steps, help="comma-separated 1-based optimizer steps, e.g. 3,5")
    with exit_on_user_error():
        args, run_argv = ap.parse_known_args(argv)
        bad = poisoned_inputs(run_argv, args.steps)
        if args.backend == "jaxtrain":
            from jaxtrain import run
            poison_jaxtrain(bad)
        else:
            from torchref import run
            poison_torchref(bad)
    run.main(run_argv)


if __name__ == "__main__":
    main()
