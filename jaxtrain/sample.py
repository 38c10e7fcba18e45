"""`python -m jaxtrain.sample --run out/tiny [--step N] --prompt "def "`: text from a trained run, or from a model's
weights (--from FOLDER: a Hugging Face GPT-2 folder among them, as nanoGPT's sample.py samples HF's weights).

    python -m jaxtrain.sample --run out/tiny --prompt "def " --max_new_tokens 200 --temperature 0.8 --top_k 40
    python -m jaxtrain.sample --run out/gpt2 --prompt "Once" --top_p 0.9 --num_samples 3 --stop_at_eot
    python -m jaxtrain.sample --from my-gpt2-hf --prompt "Once upon a time" --temperature 0

Loads a checkpoint of the run (the newest complete one, or --step), or the folder (model_source.py), encodes the
prompt with the tokenizer of the data the run trained on (bytes or GPT-2's BPE) or the folder's, generates, and
prints the prompt and its continuation decoded (--num_samples of them, a line of dashes between two, as nanoGPT's
sample.py).

Generation is one jitted call: the prompt runs through the model once (the prefill), filling a KV cache of
model.seq_len positions (model.KVCache), and each further token is one cached step of a `while_loop`. The model has
no positions past seq_len, so once the text outgrows them each token is predicted as nanoGPT's `generate` does: a
full forward pass over the last seq_len tokens. Either way the token after a text of n tokens is drawn from the
model's logits at the last of its last min(n, seq_len) tokens, so the cache changes the cost, never the text. The
draw: temperature 0 (or one below fp32's smallest normal number) is the argmax; otherwise softmax(logits /
temperature) over the top_k largest logits (nanoGPT's rule: ties with the k-th are kept), then over the fewest
likeliest of those whose probabilities sum to at least top_p (Hugging Face's nucleus rule; ties with the last kept
are kept), with sample r's token i drawn with the key jax.random.fold_in(fold_in(key(seed), i), r): the same texts
for a seed, and sample r's keys the same whatever --num_samples (its text too where the logits do not depend on the
batch size, as on a CPU). --stop_at_eot ends each text before its first
<|endoftext|> (GPT-2's eos_token_id), as Hugging Face's generate does; generation ends once every sample has one.

It computes on this machine's devices (--devices N: its first N), each weight split over gcd(the run's mesh.fsdp, N)
of them as the run split it (a run's, restored straight into that layout: a model larger than one device is sampled;
a model without a run is whole on each), the prompts whole on each, XLA splitting each step's work as the weights
are split; by default on the fewest that split each weight into the most pieces (the largest divisor of the run's
mesh.fsdp up to the machine's count: more would draw the same texts again), a run's read straight onto them.
A run's end-of-run sample draws so from the params where the run holds them, every process computing. Sums split
over devices may round otherwise than on one, so a draw may differ where two logits tie to within that rounding
(tests/test_sample_devices.py: the same text on 4, 2 and 1 CPU devices).
"""

import argparse
import dataclasses
import functools
import math
import shlex
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxtrain import dryrun
from jaxtrain import mesh as mesh_lib
from jaxtrain import model as model_lib
from jaxtrain import prepare as prepare_lib
from jaxtrain import model_source
from jaxtrain.autocast import backend, rounding_options
from jaxtrain.config import Config, ModelConfig
from jaxtrain.config_checks import INT32_MAX
from jaxtrain.errors import OneLineParser, UserError, exit_on_interrupt, exit_on_user_error
from jaxtrain.model_source import Tokenizer

EMPTY_PROMPT = "the prompt is empty; give one with --prompt (e.g. --prompt $'\\n' for a new line)"
MAX_SAMPLES = 1024  # texts drawn as one batch: 1024 of GPT-2 124M's KV caches (1024 positions, bf16) are 38 GB
DEFAULT_PROMPT = "\n"  # (log.sample_prompt's default too)
SAMPLE_RULE = "-" * 15  # the line between two samples, nanoGPT's


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each token is drawn. nanoGPT's sample.py defaults; temperature 0 is greedy, top_k 0 keeps every token,
    top_p 1 every token top_k kept (Hugging Face's default)."""
    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 200
    top_p: float = 1.0
    seed: int = 0
    num_samples: int = 1
    stop_at_eot: bool = False

    def check(self) -> None:
        if self.max_new_tokens <= 0:
            raise UserError(f"--max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.max_new_tokens >= INT32_MAX:  # with a prompt of one token, the text's last position is INT32_MAX
            raise UserError(f"--max_new_tokens must be below {INT32_MAX} (2**31 - 1: the text's positions are "
                            f"int32), got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UserError(f"--temperature must be a finite number >= 0 (0: always the likeliest token), "
                            f"got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"--top_k must be >= 0 (0: every token), got {self.top_k}")
        if not 0 < self.top_p <= 1:  # (NaN too)
            raise UserError(f"--top_p must be in (0, 1] (1: every token), got {self.top_p}")
        if not 0 < self.num_samples <= MAX_SAMPLES:
            raise UserError(f"--num_samples must be in [1, {MAX_SAMPLES}] (one batch of texts), "
                            f"got {self.num_samples}")
        if not 0 <= self.seed < 2**32:
            raise UserError(f"--seed must be in [0, 2**32), got {self.seed}")


def next_token(logits_BxV: jax.Array, key: jax.Array, temperature: float, top_k: int,
               top_p: float = 1.0) -> jax.Array:
    """Token ids (B,) drawn from the logits, row r with the key fold_in(key, r): see the module's docstring."""
    logits_BxV = logits_BxV.astype(jnp.float32)
    if temperature < np.finfo(np.float32).tiny:  # 0, or so small that fp32 would make it 0: softmax's limit
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits_BxV = drawn_logits(logits_BxV, temperature, top_k, top_p)
    rows_B = jnp.arange(logits_BxV.shape[0])
    draw = jax.vmap(lambda row, logits_V: jax.random.categorical(jax.random.fold_in(key, row), logits_V))
    return draw(rows_B, logits_BxV).astype(jnp.int32)


def drawn_logits(logits_BxV: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """The fp32 logits the draw's softmax takes (temperature > 0): divided by the temperature, the tokens that top_k
    and then top_p leave out at -inf."""
    # less the max first: divided by a tiny temperature, the largest logits would overflow to inf and tie
    logits_BxV = (logits_BxV - jnp.max(logits_BxV, axis=-1, keepdims=True)) / temperature
    if 0 < top_k < logits_BxV.shape[-1]:
        kth_Bx1 = jax.lax.top_k(logits_BxV, top_k)[0][:, -1:]
        logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
    if top_p < 1:
        logits_BxV = jnp.where(logits_BxV < _nucleus_floor(logits_BxV, top_p), -jnp.inf, logits_BxV)
    return logits_BxV


def _nucleus_floor(logits_BxV: jax.Array, top_p: float) -> jax.Array:
    """(B, 1): the smallest logit of the nucleus, the likeliest tokens down to the first whose own probability takes
    their sum to top_p: a token is kept where the tokens likelier than it hold less than top_p (Hugging Face's
    TopPLogitsWarper removes those whose less likely tokens, themselves included, hold at most 1 - top_p)."""
    sorted_BxV = -jnp.sort(-logits_BxV, axis=-1)
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    likelier_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    kept_Bx1 = jnp.sum(likelier_BxV < top_p, axis=-1, keepdims=True)  # >= 1: the likeliest has none likelier
    return jnp.take_along_axis(sorted_BxV, kept_Bx1 - 1, axis=-1)


def generator(graphdef, model_cfg: ModelConfig, precision: str, sampling: Sampling, stop_id: int | None = None,
              out_sharding: NamedSharding | None = None):
    """A jitted (params, prompts (B, P) int32) -> tokens (B, P + max_new_tokens) laid out as `out_sharding` says
    (None: as XLA chooses): the prompts and their continuations. With `stop_id`, generation ends once every row has
    drawn it; the positions after the row's first are then tokens drawn after it, or -1 where none was."""
    L, N = model_cfg.seq_len, sampling.max_new_tokens
    base_key = jax.random.key(sampling.seed)
    stop = -2 if stop_id is None else stop_id  # -2: no token id, so no row stops

    def generate(params, prompt_BxP):
        B, P = prompt_BxP.shape
        tokens_BxS = jnp.full((B, P + N), -1, jnp.int32).at[:, :P].set(prompt_BxP)
        stopped_B = jnp.zeros((B,), bool)

        def put(i, tokens_BxS, logits_BxV):  # token i of the continuation, drawn and written at position P + i
            token_B = next_token(logits_BxV, jax.random.fold_in(base_key, i), sampling.temperature, sampling.top_k,
                                 sampling.top_p)
            return jax.lax.dynamic_update_slice(tokens_BxS, token_B[:, None], (0, P + i))

        def tokens_from(i, end, step, carry, stopped_B, tokens_of=lambda carry: carry):
            """(carry, stopped_B) through step(i, carry) .. step(end - 1, carry), ending early once every row has
            drawn stop_id (stopped_B: the rows that have; each step looks at the token it drew alone)."""
            def more(state):
                return (state[0] < end) & ~jnp.all(state[2])

            def drawn(state):
                i, carry, stopped_B = state
                carry = step(i, carry)
                token_B = jax.lax.dynamic_slice(tokens_of(carry), (0, P + i), (B, 1))[:, 0]
                return i + 1, carry, stopped_B | (token_B == stop)
            return jax.lax.while_loop(more, drawn, (i, carry, stopped_B))[1:]

        # Token i follows a text of P + i tokens: from the cache while that fits in seq_len, cropped past it.
        n_cached = max(0, min(N, L - P + 1))
        if n_cached:
            logits_BxPxV, caches = model_lib.extend(graphdef, params, prompt_BxP,
                                                    model_lib.empty_caches(model_cfg, batch=B, precision=precision))
            tokens_BxS = put(0, tokens_BxS, logits_BxPxV[:, -1])
            stopped_B = tokens_BxS[:, P] == stop

            def cached_step(i, carry):
                tokens_BxS, caches = carry
                last_Bx1 = jax.lax.dynamic_slice(tokens_BxS, (0, P + i - 1), (B, 1))
                logits_Bx1xV, caches = model_lib.extend(graphdef, params, last_Bx1, caches)
                return put(i, tokens_BxS, logits_Bx1xV[:, 0]), caches

            (tokens_BxS, _), stopped_B = tokens_from(1, n_cached, cached_step, (tokens_BxS, caches), stopped_B,
                                                     lambda carry: carry[0])

        def cropped_step(i, tokens_BxS):
            context_BxL = jax.lax.dynamic_slice(tokens_BxS, (0, P + i - L), (B, L))
            return put(i, tokens_BxS, model_lib.apply(graphdef, params, context_BxL)[:, -1])

        if n_cached < N:  # (a loop of no steps is traced all the same, and its slice would not fit)
            tokens_BxS, _ = tokens_from(n_cached, N, cropped_step, tokens_BxS, stopped_B)
        return tokens_BxS

    # rounding as the train step's forward pass does (autocast.rounding_options): on a GPU every rounding, and a bf16
    # stream's on any backend
    options = rounding_options(backend(), precision, model_cfg.residual_dtype == "bf16")
    return jax.jit(generate, out_shardings=out_sharding, compiler_options=options)


def prompt_ids(tok: Tokenizer, prompt: str, sampling: Sampling, vocab_size: int) -> list[int]:
    """The prompt's token ids, once the prompt and `sampling` are checked against the tokenizer and the model: each
    refusal one line, before any compilation."""
    sampling.check()
    if sampling.stop_at_eot and tok.eot is None:
        raise UserError("--stop_at_eot: the run's tokenizer (bytes) has no end-of-text token; leave the flag out")
    ids = tok.encode(prompt)
    if not ids:
        raise UserError(EMPTY_PROMPT)
    if len(ids) + sampling.max_new_tokens > INT32_MAX:
        raise UserError(f"the prompt's {len(ids)} tokens and --max_new_tokens {sampling.max_new_tokens} make a text "
                        f"longer than int32 positions reach ({INT32_MAX}); ask for at most "
                        f"{INT32_MAX - len(ids)} new tokens")
    if max(ids) >= vocab_size:
        raise UserError(f"the prompt encodes to token id {max(ids)}, beyond the model's vocabulary of {vocab_size}: "
                        f"the run was trained with another tokenizer; pass the one its data used "
                        f"({' or '.join(prepare_lib.TOKENIZERS)})")
    return ids


def sample_texts(params, model_cfg: ModelConfig, precision: str, tok: Tokenizer, prompt: str,
                 sampling: Sampling) -> list[str]:
    """The prompt and its continuation, as text, sampling.num_samples times, from the model `model_cfg` with `params`
    computing in `precision` (drawer's, drawn at once)."""
    return drawer(params, model_cfg, precision, tok, prompt, sampling)()


def drawer(params, model_cfg: ModelConfig, precision: str, tok: Tokenizer, prompt: str, sampling: Sampling,
           shortfall: Callable | None = None) -> Callable[[], list[str]]:
    """sample_texts compiled: a function that draws the texts. Refused in one line before that where the prompt
    does not fit (prompt_ids) or where the texts need more memory at once than a device has (`shortfall` of the
    compiled generator and its mesh: what it needs, in words, or None; dryrun.shortfall unless given: this
    process's judgement alone, as an allocator's refusal at the compile or the draw, the same line).

    Attention is the written-out one (model.attention xla), which the cached steps take whatever the config says:
    one computation for the whole text, and cuDNN's kernel is no choice on a machine without a GPU. So is c_fc with
    GELU (model.gelu_fwd xla: the same function): gelu_gemm's kernel takes tokens in tiles of 64 rows, and decoding
    brings one at a time."""
    ids = prompt_ids(tok, prompt, sampling, model_cfg.vocab_size)
    # computed_here: the forward kernels the defaults pick, not one the run named; a bf16 residual stream (bf16
    # arithmetic) sampled in another --precision is that precision's, fp32, as config_checks has it in training
    model_cfg = dataclasses.replace(model_source.computed_here(model_cfg, precision)[0], attention="xla",
                                    gelu_fwd="xla")
    graphdef = model_lib.graphdef(model_cfg, vocab_size=model_cfg.vocab_size, precision=precision)
    stop_id = tok.eot if sampling.stop_at_eot else None
    prompts, whole = _whole_on_each_device(params, np.asarray([ids] * sampling.num_samples, np.int32))
    mesh = whole.mesh if whole is not None else mesh_lib.one_device_mesh()
    out_of_memory = functools.partial(dryrun.out_of_memory, lambda needs: _too_big(sampling, mesh, needs))
    with out_of_memory():  # XLA:TPU refuses at compile time what does not fit
        compiled = generator(graphdef, model_cfg, precision, sampling, stop_id, whole).lower(params, prompts)
        compiled = compiled.compile()
    if (needs := (shortfall or dryrun.shortfall)(compiled, mesh)) is not None:
        raise _too_big(sampling, mesh, needs)

    def draw() -> list[str]:
        with out_of_memory():
            tokens = np.asarray(compiled(params, prompts).addressable_shards[0].data)  # whole on each device
        return [tok.decode(_before_stop(row, len(ids), stop_id)) for row in tokens]
    return draw


def _too_big(sampling: Sampling, mesh, needs: str) -> UserError:
    """The refusal of sampling.num_samples texts drawn at once on `mesh`'s devices, which `needs` more memory than
    one has, with the levers that lower it: fewer texts (each holds a KV cache of seq_len positions a layer); on a
    CPU, whose devices share the host's memory and each hold their copy of what is not split, one device."""
    n = sampling.num_samples
    levers = ["lower --num_samples (each text holds its own KV cache)"] if n > 1 else []
    if mesh.size > 1 and mesh.devices.flat[0].platform == "cpu":
        levers.append(f"compute on {dryrun.one_device('the KV caches, and what is not split,')}")
    fix = ", or ".join(levers) or f"one text is the least: sample on {dryrun.more_memory(mesh.devices.flat[0])}"
    return UserError(f"drawing {n} text{'s' if n > 1 else ''} at a time {needs}; {fix}")


def _whole_on_each_device(params, prompts_BxP: np.ndarray) -> tuple[jax.Array | np.ndarray, NamedSharding | None]:
    """(the prompts, the sharding the tokens come back in): on a mesh where `params` are split over one (a run's,
    model_source.placed's: of one process or many), whole on each of its devices, as the tokens then are (every
    process calls the generator and reads them; XLA splits each step's work as the weights are split); otherwise as
    they are and None (the default device)."""
    sharding = getattr(jax.tree.leaves(params)[0], "sharding", None)  # (numpy arrays: none)
    if not isinstance(sharding, NamedSharding):
        return prompts_BxP, None
    whole = mesh_lib.replicated(sharding.mesh)
    return mesh_lib.global_array(prompts_BxP, whole), whole


def _prompt_flag(prompt: str) -> str:
    """` --prompt=<prompt>` as a shell reads it back on one line (bash's $'...' where it holds a new line or another
    character that does not print), nothing for the default prompt; `=`: a prompt may begin with a dash."""
    if prompt == DEFAULT_PROMPT:
        return ""
    if prompt.isprintable():
        return f" --prompt={shlex.quote(prompt)}"

    def escaped(c: str) -> str:
        if c in "\\'":
            return "\\" + c
        return c if c.isprintable() else {"\n": "\\n", "\t": "\\t"}.get(c, f"\\U{ord(c):08x}")
    return f" --prompt=$'{''.join(map(escaped, prompt))}'"


def print_end_of_run_sample(cfg: Config, params, tokenizer: Tokenizer, is_main: bool) -> None:
    """jaxtrain.run's end-of-run sample: log.sample_tokens tokens after log.sample_prompt, drawn by this module's
    defaults with run.seed from the run's params where they are (each weight split over the run's mesh as it
    trained: every process computes, a collective; never gathered whole onto one device), printed on stdout by the
    main process, as `python -m jaxtrain.sample` prints it.

    Compiled, it is checked against what each device has left beside the trained state, which stays
    (dryrun.shortfall_beside: XLA's count of the generator leaves that state out), and every process votes before
    a token is drawn, so that all draw or none: one refusing alone, at the compile or the check, left the others
    in the sample's collectives indefinitely (still waiting after 300 s in tests/test_preemption.py). An
    allocator's refusal of the draw itself is one process's alone, and the same line."""
    sampling = Sampling(max_new_tokens=cfg.log.sample_tokens, seed=cfg.run.seed)
    try:  # the prompt and the token count were checked at the start: a refusal here is the memory's
        draw = drawer(params, cfg.model, cfg.train.precision, tokenizer, cfg.log.sample_prompt, sampling,
                      shortfall=dryrun.shortfall_beside)
    except UserError:
        draw = None
    if mesh_lib.each_process(np.asarray([draw is None], np.uint8)).any():
        raise _end_of_run_refused(cfg)
    try:
        [text] = draw()
    except UserError:
        raise _end_of_run_refused(cfg) from None
    if not is_main:
        return
    print(f"sample ({cfg.log.sample_tokens} tokens, temperature {sampling.temperature}, top_k {sampling.top_k}):",
          file=sys.stderr)
    print(text, flush=True)


def _end_of_run_refused(cfg: Config) -> UserError:
    """The end-of-run sample's refusal: the run is saved, and the command that draws the same sample."""
    again = (f"python -m jaxtrain.sample --run {shlex.quote(cfg.run.out_dir)}{_prompt_flag(cfg.log.sample_prompt)} "
             f"--max_new_tokens {cfg.log.sample_tokens} --seed {cfg.run.seed}")
    return UserError(f"the end-of-run sample (log.sample_tokens={cfg.log.sample_tokens}) needs more memory than a "
                     f"device has beside the trained state; the run is trained and saved: draw it with `{again}`, "
                     f"or train without it: --log.sample_tokens=0")


def _before_stop(tokens: np.ndarray, prompt_len: int, stop_id: int | None) -> np.ndarray:
    """The prompt and its continuation up to its first stop_id (None: all of it)."""
    stops = np.flatnonzero(tokens[prompt_len:] == stop_id) if stop_id is not None else ()
    return tokens[:prompt_len + stops[0]] if len(stops) else tokens


def _fewest_splitting(devices: list) -> Callable[[Config | None], list]:
    """The rule (model_source.Devices) by which sample computes on the fewest of `devices` that split each weight of
    a run into the most pieces (the largest divisor of its mesh.fsdp up to their count: fsdp 4 on 3 GPUs, 2): the
    prompts are whole on each, so more would draw the same texts again."""
    def fewest(run: Config | None) -> list:
        return devices[:min(mesh_lib.most_splitting(model_source.fsdp_of(run), range(1, len(devices) + 1)))]
    return fewest


def _parser() -> argparse.ArgumentParser:
    defaults = Sampling()
    ap = OneLineParser(prog="python -m jaxtrain.sample",
                       description="Text from a checkpoint of a trained run, or from a model's weights.",
                       epilog='examples:\n'
                              '  python -m jaxtrain.sample --run out/tiny --prompt "def " --temperature 0\n'
                              '  python -m jaxtrain.sample --from my-gpt2-hf --prompt "Once upon a time"',
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    model_source.add_arguments(ap)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="the text to continue (default: a new line)")
    ap.add_argument("--max_new_tokens", type=int, default=defaults.max_new_tokens,
                    help=f"tokens to draw after the prompt (default {defaults.max_new_tokens})")
    ap.add_argument("--temperature", type=float, default=defaults.temperature,
                    help=f"0: always the likeliest token (default {defaults.temperature})")
    ap.add_argument("--top_k", type=int, default=defaults.top_k,
                    help=f"draw among the k likeliest tokens; 0: all (default {defaults.top_k})")
    ap.add_argument("--top_p", type=float, default=defaults.top_p,
                    help="then draw among the fewest likeliest tokens whose probabilities sum to at least p; 1: all "
                         f"(default {defaults.top_p})")
    ap.add_argument("--seed", type=int, default=defaults.seed, help="the same seed gives the same texts")
    ap.add_argument("--num_samples", type=int, default=defaults.num_samples,
                    help=f"texts to draw, as one batch (default {defaults.num_samples})")
    ap.add_argument("--stop_at_eot", action="store_true",
                    help="end each text before its first <|endoftext|> (GPT-2's tokenizer)")
    ap.add_argument("--devices", type=int, help="how many of this machine's devices compute (its first N), each "
                                                "weight split over gcd(the run's mesh.fsdp, N) of them, whole on "
                                                "each for a model without a run (the rest draw the same texts); "
                                                "default: the fewest that split each weight into the most pieces")
    ap.add_argument("--tokenizer", choices=prepare_lib.TOKENIZERS,
                    help="default, and the only one accepted where the run's data folder is here and still holds "
                         "the data the run trained on: that data's (a Hugging Face folder's: GPT-2's BPE where its "
                         "tokenizer files are GPT-2's)")
    return ap


def main(argv: list[str] | None = None) -> None:
    with exit_on_user_error(), exit_on_interrupt("nothing was written"):
        args = _parser().parse_args(argv)
        sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                            args.num_samples, args.stop_at_eot)
        sampling.check()  # before the checkpoint is read
        if not args.prompt:  # as is an empty prompt (any text encodes to at least one token)
            raise UserError(EMPTY_PROMPT)
        devices = model_source.machine_devices(args.devices)
        run = model_source.load(args, "sample", devices if args.devices is not None else _fewest_splitting(devices))
        tokenizer = model_source.text_tokenizer(run, args.tokenizer)
        draw = drawer(run.params, run.model_cfg, run.precision, tokenizer, args.prompt, sampling)  # no header yet
        print(f"{run.source}, {run.precision}, temperature {sampling.temperature}, top_k {sampling.top_k}, top_p "
              f"{sampling.top_p}, seed {sampling.seed}{model_source.on_devices(run)}", file=sys.stderr)
        print(f"\n{SAMPLE_RULE}\n".join(draw()))


if __name__ == "__main__":
    main()
