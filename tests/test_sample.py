"""Sampling (jaxtrain.sample): the KV-cached generation against nanoGPT's rule written out with the full forward
pass, the draw against softmax written out in numpy, the tokenizers against known ids, and the command line."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings

from test_convert import copy_step
from test_run import small_args
from jaxtrain import autocast, config, convert, data, model, prepare, run, run_tokenizer, sample, model_source
from jaxtrain.errors import UserError

STEPS = 40  # enough that the logits are far from uniform: top-2 gaps mostly well above the rounding bounds below
PROMPT = "def "


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_dir):
    """A run of the small model (fp32, seq_len 32) to step 40, through `python -m jaxtrain.run` with the
    end-of-run sample on: (run folder, the run's stdout, its stderr)."""
    out_dir = str(tmp_path_factory.mktemp("trained"))
    proc = subprocess.run([sys.executable, "-m", "jaxtrain.run", *small_args(
        out_dir, cache_dir, f"--train.steps={STEPS}", "--checkpoint.every=20", "--train.eval_every=20",
        "--log.sample_tokens=40", f"--log.sample_prompt={PROMPT}")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out_dir, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def loaded(trained):
    return model_source.from_run(trained[0], None, None, "sample")


@pytest.fixture(scope="module")
def tokenizer(loaded):
    return model_source.text_tokenizer(loaded, None)


# The forward pass compiled as the train step compiles it on this backend (autocast.rounding_options), for each
# residual stream: a bf16 stream's roundings kept, which XLA:CPU otherwise drops
_APPLY = {stream: jax.jit(model.apply, static_argnums=0, compiler_options=autocast.rounding_options(
    jax.default_backend(), bf16_stream=stream == "bf16")) for stream in ("fp32", "bf16")}


def full_forward_logits(graphdef, params, ids: list[int], seq_len: int, stream: str = "fp32") -> np.ndarray:
    """nanoGPT's generate written out: the next token's logits (V,) from the whole context, cropped to its last
    seq_len tokens."""
    context = jnp.asarray([ids[-seq_len:]], jnp.int32)
    return np.asarray(_APPLY[stream](graphdef, params, context)[0, -1], np.float32)


def greedy_reference(graphdef, params, prompt: list[int], n: int, seq_len: int,
                     stream: str = "fp32") -> tuple[list[int], list[float]]:
    """The prompt and n tokens, each the argmax of the full forward pass; and each step's top-2 logit gap."""
    ids, gaps = list(prompt), []
    for _ in range(n):
        logits = full_forward_logits(graphdef, params, ids, seq_len, stream)
        top2 = np.sort(logits)[-2:]
        gaps.append(float(top2[1] - top2[0]))
        ids.append(int(np.argmax(logits)))
    return ids, gaps


# A prompt of 28 tokens and 30 more: the prefill's and 4 cached steps' continue from the KV cache, the rest past
# seq_len 32 from a cropped context. The reference compiles a forward pass for each context length (28 to 32, each
# ~0.6 s here); test_cached_logits_are_the_full_forward_logits takes the cache through 12 steps.
LONG_PROMPT = list(b"def forward(self, x): return")
N_NEW = 30


def _generate(loaded, precision, **sampling):
    graphdef = model.graphdef(loaded.model_cfg, vocab_size=loaded.model_cfg.vocab_size, precision=precision)
    generate = sample.generator(graphdef, loaded.model_cfg, precision, sample.Sampling(max_new_tokens=N_NEW,
                                                                                        **sampling))
    return graphdef, [int(t) for t in generate(loaded.params, np.asarray([LONG_PROMPT], np.int32))[0]]


def _generate_seeing_logits(loaded, precision, monkeypatch, **sampling):
    """_generate, and the logits (V,) each new token was drawn from, in order: a spy around sample.next_token."""
    seen, draw = [], sample.next_token

    def spy(logits_BxV, *rule):
        jax.debug.callback(lambda x: seen.append(np.asarray(x, np.float32)), logits_BxV[0], ordered=True)
        return draw(logits_BxV, *rule)

    monkeypatch.setattr(sample, "next_token", spy)
    graphdef, tokens = _generate(loaded, precision, **sampling)
    assert len(seen) == N_NEW
    return graphdef, tokens, seen


# fp16 keeps 3 more mantissa bits than bf16 (one ulp is 2^-11 relative): the same 4 ulps of a logit's scale, 0.003
# (measured 0 here too; fp16's logits are fp16 and sit 3e-4 from fp32's, bf16's 3e-3: the model computes in fp16).
FP16_ATOL = 0.003

# fp32 logits of the cached steps and the full forward pass differ by summation order only (the cache's masked zero
# keys, other dot shapes): measured 4.8e-7 on logits of scale 1.1, bound 1e-5, margin 20x. Under bf16 a sum taken in
# another order can move a bf16 activation by one ulp (2^-8 relative) and a logit by about as much: bound 4 ulps of
# that scale, 0.02 (measured 0 here: XLA:CPU computed the same bits both ways).
LOGIT_ATOL = {"fp32": 1e-5, "bf16": 0.02, "fp16": FP16_ATOL}


# A bf16 residual stream: the sampler's logits are the full forward's, each rounding kept on both sides (measured
# equal at all 30 tokens, cached and cropped): a bound below the one rounding's difference it must catch (a sampler
# that let XLA drop the stream's roundings was 2^-8 off at each token).
STREAM_ATOL = 1e-3


@pytest.mark.parametrize("precision,stream", [("fp32", "fp32"), ("bf16", "fp32"), ("fp16", "fp32"), ("bf16", "bf16")])
def test_greedy_continuation_is_the_full_forward_argmax(loaded, precision, stream, monkeypatch):
    loaded = loaded._replace(model_cfg=dataclasses.replace(loaded.model_cfg, residual_dtype=stream))
    assert len(LONG_PROMPT) + 1 < loaded.model_cfg.seq_len < len(LONG_PROMPT) + N_NEW  # cached steps and cropped
    graphdef, got, logits = _generate_seeing_logits(loaded, precision, monkeypatch, temperature=0.0)
    want, gaps = greedy_reference(graphdef, loaded.params, LONG_PROMPT, N_NEW, loaded.model_cfg.seq_len, stream)
    # Token for token the reference's, up to its first near-tie, which rounding alone could flip (none here under
    # jax 0.10.2 or 0.12.0.1, the smallest top-2 gap 0.12; a 20-token prompt's first bf16 token was 2 ulps under
    # 0.12.0.1: from such a tie the texts may part)
    agree = len(LONG_PROMPT) + next((i for i, gap in enumerate(gaps) if gap <= 2 * LOGIT_ATOL[precision]), N_NEW)
    assert got[:agree] == want[:agree]
    assert precision != "fp32" or agree == len(want)  # fp32's bound is 20x its measured error: no near-tie to meet
    for i, step_logits in enumerate(logits):  # each token's whole distribution, not only its argmax
        assert got[len(LONG_PROMPT) + i] == np.argmax(step_logits), f"token {i}"  # greedy: the largest it saw
        np.testing.assert_allclose(step_logits, full_forward_logits(
            graphdef, loaded.params, got[:len(LONG_PROMPT) + i], loaded.model_cfg.seq_len, stream),
            rtol=0, atol=STREAM_ATOL if stream == "bf16" else LOGIT_ATOL[precision], err_msg=f"token {i}")


def test_a_bf16_stream_run_sampled_in_fp32_runs_an_fp32_stream(loaded, monkeypatch, tokenizer):
    """--precision fp32 on a run trained with model.residual_dtype=bf16: fp32 arithmetic throughout, the stream too
    (a bf16 stream beside fp32 Linears would be promoted to fp32 at its first add by XLA's ops but stay bf16 in the
    norm kernels): the sampler is built for an fp32 stream and gives the text of the same config with one."""
    seen, built, real = {}, [], sample.generator
    monkeypatch.setattr(sample, "generator", lambda graphdef, cfg, *a: (built.append(cfg.residual_dtype),
                                                                         real(graphdef, cfg, *a))[1])
    for stream in ("bf16", "fp32"):
        cfg = dataclasses.replace(loaded.model_cfg, residual_dtype=stream)
        seen[stream] = sample.sample_texts(loaded.params, cfg, "fp32", tokenizer, "hello",
                                           sample.Sampling(max_new_tokens=4))
    assert built == ["fp32", "fp32"] and seen["bf16"] == seen["fp32"]


def test_a_rematted_model_samples_what_it_samples_without(loaded):
    """model.remat=dots past seq_len, where each token is a forward pass of the cropped context in a fori_loop that
    closes over the params (before, flax refused nnx.remat's write-back there): the same greedy text."""
    rematted = loaded._replace(model_cfg=dataclasses.replace(loaded.model_cfg, remat="dots"))
    assert _generate(rematted, "fp32", temperature=0.0)[1] == _generate(loaded, "fp32", temperature=0.0)[1]


def test_a_model_trained_with_the_gelu_kernel_samples_through_xlas_mlp(loaded, tokenizer):
    """model.gelu_fwd=pallas's kernel takes tokens in tiles of 64 rows and decoding brings one at a time: a run
    trained with it samples (sample_text, as `python -m jaxtrain.sample` and the end-of-run sample call it) the
    text XLA's MLP gives, the same function."""
    texts = [sample.sample_texts(loaded.params, dataclasses.replace(loaded.model_cfg, gelu_fwd=gelu_fwd), "bf16",
                                tokenizer, "hello", sample.Sampling(max_new_tokens=4, temperature=0.0))
             for gelu_fwd in ("pallas", "xla")]
    assert texts[0] == texts[1] and texts[0][0].startswith("hello")


def test_sampled_tokens_come_from_the_full_forward_top_k(loaded, monkeypatch):
    """At temperature 1 the text varies, and so the contexts: each token's logits are the full forward's on its
    context, and the token is among their 10 largest."""
    graphdef, got, logits = _generate_seeing_logits(loaded, "fp32", monkeypatch, temperature=1.0, top_k=10, seed=5)
    assert len(set(got[len(LONG_PROMPT):])) > 5, got
    for i, step_logits in enumerate(logits):
        want = full_forward_logits(graphdef, loaded.params, got[:len(LONG_PROMPT) + i], loaded.model_cfg.seq_len)
        np.testing.assert_allclose(step_logits, want, rtol=0, atol=LOGIT_ATOL["fp32"], err_msg=f"token {i}")
        assert want[got[len(LONG_PROMPT) + i]] >= np.sort(want)[-10], i


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_cached_logits_are_the_full_forward_logits(loaded, precision):
    """Prefill 20 tokens, then 12 cached steps of one token, against model.apply on all 32 at once."""
    cfg = loaded.model_cfg
    graphdef = model.graphdef(cfg, vocab_size=cfg.vocab_size, precision=precision)
    ids = jnp.asarray([list(b"def forward(self, x):\n    return self.proj(x) + 1")[:cfg.seq_len]], jnp.int32)
    full = np.asarray(_APPLY["fp32"](graphdef, loaded.params, ids), np.float32)
    extend = jax.jit(model.extend, static_argnums=0)
    logits, caches = extend(graphdef, loaded.params, ids[:, :20], model.empty_caches(cfg, batch=1,
                                                                                     precision=precision))
    cached = [logits]
    for t in range(20, cfg.seq_len):
        logits, caches = extend(graphdef, loaded.params, ids[:, t:t + 1], caches)
        cached.append(logits)
    cached = np.asarray(jnp.concatenate(cached, axis=1), np.float32)
    assert int(caches[0].length) == cfg.seq_len
    np.testing.assert_allclose(cached, full, rtol=0, atol=LOGIT_ATOL[precision])


def test_top_k_1_is_greedy_and_a_seed_fixes_the_text(loaded):
    graphdef, greedy = _generate(loaded, "fp32", temperature=0.0)
    assert _generate(loaded, "fp32", temperature=1.0, top_k=1, seed=3)[1] == greedy
    seed_0 = _generate(loaded, "fp32", temperature=1.0, top_k=0, seed=0)[1]
    assert _generate(loaded, "fp32", temperature=1.0, top_k=0, seed=0)[1] == seed_0
    # 30 draws at temperature 1 from a barely trained byte model: the same 30 tokens again is vanishingly unlikely
    assert _generate(loaded, "fp32", temperature=1.0, top_k=0, seed=1)[1] != seed_0


def test_samples_differ_and_the_first_is_the_single_samples_text(loaded, tokenizer):
    """num_samples 3 at temperature 1: three texts, the first that of num_samples 1 with the same seed (sample r's
    keys do not depend on how many are drawn)."""
    def texts(n):
        return sample.sample_texts(loaded.params, loaded.model_cfg, "fp32", tokenizer, PROMPT, sample.Sampling(
            max_new_tokens=N_NEW, temperature=1.0, top_k=0, seed=2, num_samples=n))
    one, three = texts(1), texts(3)
    assert len(one) == 1 and three[0] == one[0] and len(set(three)) == 3, three


def test_row_r_draws_with_the_key_fold_in_key_r():
    """The module's rule, sample r's key fold_in(key, r): what makes sample r's text the same whatever the batch."""
    logits, key = jax.random.normal(jax.random.key(0), (3, 50)), jax.random.key(7)
    want = [int(jax.random.categorical(jax.random.fold_in(key, r), logits[r])) for r in range(3)]
    assert sample.next_token(logits, key, 1.0, 0).tolist() == want


def test_stop_at_eot_ends_each_text_before_its_first_and_generation_when_all_have_one(loaded, tokenizer):
    """The byte model, with a token its three samples all draw standing in for <|endoftext|>: each row's tokens up
    to its first stop are those drawn without one; after the last row's first, none is drawn (-1); the texts end
    before their first."""
    graphdef = model.graphdef(loaded.model_cfg, vocab_size=loaded.model_cfg.vocab_size, precision="fp32")
    prompts, P = np.asarray([LONG_PROMPT] * 3, np.int32), len(LONG_PROMPT)
    rule = sample.Sampling(max_new_tokens=N_NEW, temperature=1.0, top_k=5, seed=4)  # texts that share tokens
    free = np.asarray(sample.generator(graphdef, loaded.model_cfg, "fp32", rule)(loaded.params, prompts))
    shared = set.intersection(*(set(row[P:].tolist()) for row in free))
    stop_id = min(shared, key=lambda t: max(list(row[P:]).index(t) for row in free))  # all three by the earliest
    first = [list(row[P:]).index(stop_id) for row in free]
    assert max(first) < N_NEW - 1, (first, free)  # a stop that ends generation early
    stopped = np.asarray(sample.generator(graphdef, loaded.model_cfg, "fp32", rule, stop_id)(loaded.params, prompts))
    np.testing.assert_array_equal(stopped[:, :P + max(first) + 1], free[:, :P + max(first) + 1])
    assert np.all(stopped[:, P + max(first) + 1:] == -1), stopped
    tok = tokenizer._replace(eot=stop_id)
    texts = sample.sample_texts(loaded.params, loaded.model_cfg, "fp32", tok, bytes(LONG_PROMPT).decode(),
                                dataclasses.replace(rule, num_samples=3, stop_at_eot=True))
    assert texts == [tok.decode(row[:P + f]) for row, f in zip(free, first)]


def _frequencies(logits, temperature, top_k, top_p=1.0, n=20000) -> np.ndarray:
    keys = jax.random.split(jax.random.key(0), n)
    draw = jax.vmap(lambda key: sample.next_token(jnp.asarray([logits]), key, temperature, top_k, top_p)[0])
    return np.bincount(np.asarray(draw(keys)), minlength=len(logits)) / n


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


# 20000 draws: a frequency's standard deviation is at most sqrt(0.25 / 20000) = 0.0035; 5 of them.
FREQ_ATOL = 0.018


def test_draws_follow_softmax_over_temperature_among_the_top_k():
    logits = np.array([2.0, 1.0, 0.5, -1.0, 0.0], np.float32)
    want = np.zeros(5)
    want[:3] = _softmax(logits[:3] / 0.5)  # the 3 largest, sharpened by temperature 0.5: 0.84, 0.11, 0.04
    got = _frequencies(logits, 0.5, 3)
    assert got[3] == got[4] == 0
    np.testing.assert_allclose(got, want, rtol=0, atol=FREQ_ATOL)
    np.testing.assert_allclose(_frequencies(logits, 1.0, 0), _softmax(logits.astype(np.float64)), atol=FREQ_ATOL)


def test_ties_with_the_kth_logit_are_kept_and_temperature_0_is_argmax():
    logits = np.array([1.0, 0.0, 1.0, 1.0], np.float32)  # nanoGPT keeps every logit >= the k-th largest
    np.testing.assert_allclose(_frequencies(logits, 1.0, 1), [1 / 3, 0, 1 / 3, 1 / 3], atol=FREQ_ATOL)
    assert int(sample.next_token(jnp.asarray([[0.5, 3.0, -1.0]]), jax.random.key(0), 0.0, 0)[0]) == 1


def test_top_p_draws_from_the_nucleus_of_what_top_k_kept():
    """softmax([2, 1, 0.5, -1, 0]) = 0.563, 0.207, 0.126, 0.028, 0.076. top_p 0.7: 0.563 + 0.207 reach it, so the
    first two are kept (0.73, 0.27 renormalized). top_p 0.85 alone keeps three (0.563 + 0.207 < 0.85); after top_k 3
    the three are renormalized to 0.629, 0.231, 0.140, and two already reach 0.85 (Hugging Face's order: top_k
    first)."""
    logits = np.array([2.0, 1.0, 0.5, -1.0, 0.0], np.float32)
    np.testing.assert_allclose(_frequencies(logits, 1.0, 0, 0.7), [*_softmax(logits[:2]), 0, 0, 0], atol=FREQ_ATOL)
    np.testing.assert_allclose(_frequencies(logits, 1.0, 0, 0.85), [*_softmax(logits[:3]), 0, 0], atol=FREQ_ATOL)
    np.testing.assert_allclose(_frequencies(logits, 1.0, 3, 0.85), [*_softmax(logits[:2]), 0, 0, 0], atol=FREQ_ATOL)
    tied = np.array([1.0, 0.0, 1.0, 1.0], np.float32)  # the likeliest alone reach 0.3: its ties are kept with it
    np.testing.assert_allclose(_frequencies(tied, 1.0, 0, 0.3), [1 / 3, 0, 1 / 3, 1 / 3], atol=FREQ_ATOL)


# A kept set decided by a sum within this of top_p may differ by rounding alone (fp32 sums of 64 probabilities: a
# few 1e-7); such draws are set aside
NUCLEUS_EDGE = 1e-5


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), top_p=st.floats(0.01, 0.99), top_k=st.sampled_from([0, 5, 20]),
       temperature=st.sampled_from([0.5, 1.0, 2.0]))
def test_the_tokens_kept_are_hugging_faces(seed, top_p, top_k, temperature):
    """The logits left finite (the tokens the draw can give) are those transformers' TopKLogitsWarper and
    TopPLogitsWarper leave, applied in the order its generate applies them (temperature, top_k, top_p)."""
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    logits = np.random.default_rng(seed).normal(0, 3, (1, 64)).astype(np.float32)
    probs = np.sort(_softmax(np.sort(logits[0])[::-1][:top_k or 64].astype(np.float64) / temperature))[::-1]
    assume(np.all(np.abs(np.cumsum(probs) - top_p) > NUCLEUS_EDGE))
    scores = TemperatureLogitsWarper(temperature)(None, torch.from_numpy(logits))
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    want = np.isfinite(TopPLogitsWarper(top_p)(None, scores).numpy())
    kept = np.isfinite(np.asarray(sample.drawn_logits(jnp.asarray(logits), temperature, top_k, top_p)))
    assert want.sum() < 64 or top_p > 0.9  # (the rule is seen to leave tokens out)
    np.testing.assert_array_equal(kept, want)


@pytest.mark.parametrize("temperature", [1e-30, 1e-37, 1.2e-38, 1e-38, 1e-39, 1e-45, 1e-300])
def test_a_temperature_near_0_draws_the_likeliest_token(temperature):
    """Divided by such a temperature, the logits overflowed to inf and tied: categorical took the lowest index,
    token 0, not the argmax (below fp32's smallest normal, the temperature itself rounds towards 0)."""
    logits = jnp.asarray([[1.0, 2.0, -3.0], [4.999, -1.0, 5.0]])
    for seed in range(5):
        assert sample.next_token(logits, jax.random.key(seed), temperature, 0).tolist() == [1, 2]


def test_tokenizers_encode_and_decode_known_ids():
    tok = model_source.tokenizer("bytes")
    assert tok.encode("dé") == [0x64, 0xC3, 0xA9]
    assert tok.encode(os.fsdecode(b"a\xff")) == [0x61, 0xFF]  # a command line's undecodable byte, as it was given
    assert tok.decode([0x64, 0xC3, 0xA9]) == "dé"
    assert tok.decode([0x64, 0xE2, 0x82]) == "d\ufffd"  # half a character
    assert tok.decode([0x64, 300]) == "d\ufffd"  # an id of a vocabulary padded past 256
    gpt2 = model_source.tokenizer("gpt2")
    assert gpt2.encode("Hello world") == [15496, 995]  # GPT-2's own ids
    assert gpt2.encode("<|endoftext|>def") == [50256, 4299]
    assert gpt2.decode([15496, 995, 50256]) == "Hello world<|endoftext|>"
    assert gpt2.decode([15496, 50300]) == "Hello\ufffd"  # 50257..50303: the padding of vocab_size 50304
    assert gpt2.eot == 50256 and tok.eot is None  # --stop_at_eot's token: <|endoftext|>, none among bytes


def test_the_tokenizer_is_the_datas(tmp_path):
    assert data.tokenizer_name(data.DataConfig()) == "bytes"  # the embedded corpus
    tokens = np.arange(100, dtype=np.uint16)
    prepare.write_token_dir(str(tmp_path / "d"), tokens, tokens, 50257, "gpt2")
    assert data.tokenizer_name(data.DataConfig(path=str(tmp_path / "d"))) == "gpt2"
    assert data.tokenizer_name(data.DataConfig(path=str(tmp_path / "elsewhere"))) is None


def test_the_run_prints_a_sample_at_the_end(trained):
    _, stdout, stderr = trained
    assert "sample (40 tokens, temperature 0.8, top_k 200):" in stderr
    printed = stdout.split(f"step {STEPS}: eval loss ")[1].split("\n", 1)[1]  # after the last step's eval line
    assert printed.startswith(PROMPT) and len(printed) > len(PROMPT) + 1, stdout


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_the_end_of_run_sample_stops_it_with_one_line(tmp_path, cache_dir, signum):
    """After the last save, Ctrl-C or SIGTERM stops the sample at once: one line saying the run is saved, exit
    128 + signal, no traceback (a KeyboardInterrupt's, before), no sample, the last step's checkpoint intact.
    2,000 tokens past seq_len 32 take seconds (a full forward each): the signal, sent when the run's summary
    line appears, lands while the sampler compiles or runs."""
    out_dir = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-m", "jaxtrain.run", *small_args(
        out_dir, cache_dir, "--train.steps=4", "--log.sample_tokens=2000")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if line.startswith("done: "):
            break
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, stderr
    assert stderr.strip().splitlines()[-1] == (f"{signal.Signals(signum).name}: stopping now; the run is trained "
                                               f"and saved at step 4")
    assert "Traceback" not in stderr and "sample (" not in stderr, stderr
    assert stdout.splitlines()[-1].startswith("step 4: eval loss "), stdout  # and no sample after it
    assert sorted(os.listdir(os.path.join(out_dir, "checkpoints"))) == ["4"]


def test_command_line_prints_the_prompt_and_its_continuation(trained):
    proc = subprocess.run([sys.executable, "-m", "jaxtrain.sample", "--run", trained[0], "--prompt", PROMPT,
                           "--max_new_tokens", "50", "--temperature", "0"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(PROMPT) and len(proc.stdout) > len(PROMPT) + 1, proc.stdout
    assert f"step {STEPS} of {trained[0]}, fp32, temperature 0.0" in proc.stderr


def refused(capsys, argv: list[str], named: str) -> None:
    """jaxtrain.sample exits 2 with one line on stderr, naming `named` (no header line before it: a refused
    --stop_at_eot followed the "step N of RUN" line)."""
    with pytest.raises(SystemExit) as exit_info:
        sample.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and named in lines[0], err


def test_run_and_step_errors(trained, tmp_path, capsys):
    refused(capsys, ["--run", str(tmp_path / "nowhere")], f"--run {tmp_path / 'nowhere'} does not exist; pass the "
                                                          f"run.out_dir of a jaxtrain run")  # not "holds no ..."
    refused(capsys, ["--run", str(tmp_path)], "holds no complete checkpoint")
    refused(capsys, ["--run", trained[0], "--step", "7"], "no checkpoint of step 7; its steps are 20, 40")
    refused(capsys, ["--run", trained[0], "--prompt", ""], "the prompt is empty")
    refused(capsys, ["--run", str(tmp_path / "nowhere"), "--prompt", ""], "the prompt is empty")  # before loading
    refused(capsys, ["--run", ""], "--run is an empty path")  # was: "error:  holds no complete checkpoint"


def test_a_text_longer_than_int32_positions_is_refused(trained, loaded, capsys, tokenizer):
    """--max_new_tokens 3000000000 ended in jit's OverflowError, a traceback: the text's positions are int32."""
    refused(capsys, ["--run", trained[0], "--max_new_tokens", "3000000000"],
            "--max_new_tokens must be below 2147483647 (2**31 - 1")
    with pytest.raises(UserError, match="the prompt's 4 tokens and --max_new_tokens 2147483646 make a text longer "
                                        "than int32 positions reach .*ask for at most 2147483643 new tokens"):
        sample.sample_texts(loaded.params, loaded.model_cfg, "fp32", tokenizer, PROMPT,
                           sample.Sampling(max_new_tokens=2**31 - 2))


def test_command_line_prints_samples_between_rules_and_stops_only_with_an_end_of_text(trained, capsys):
    sample.main(["--run", trained[0], "--prompt", PROMPT, "--max_new_tokens", "10", "--temperature", "1",
                 "--top_p", "0.9", "--num_samples", "2"])
    captured = capsys.readouterr()
    texts = captured.out.removesuffix("\n").split("\n---------------\n")  # nanoGPT's rule
    assert len(texts) == 2 and all(text.startswith(PROMPT) for text in texts), captured.out
    assert "top_k 200, top_p 0.9, seed 0" in captured.err
    refused(capsys, ["--run", trained[0], "--stop_at_eot"],
            "--stop_at_eot: the run's tokenizer (bytes) has no end-of-text token; leave the flag out")


def test_the_header_comes_before_the_generation(trained, capsys, monkeypatch):
    """The "step N of RUN" line says what is being sampled while it is: printed once the prompt and the memory the
    texts need are checked (so that a refusal is one line, as evaluate's), before any text is drawn (a first
    version printed it after the whole generation)."""
    seen, compiled_drawer = [], sample.drawer

    def spy(*args):
        draw = compiled_drawer(*args)
        return lambda: seen.append(capsys.readouterr().err) or draw()
    monkeypatch.setattr(sample, "drawer", spy)
    sample.main(["--run", trained[0], "--prompt", PROMPT, "--max_new_tokens", "2"])
    assert len(seen) == 1 and seen[0].startswith(f"step {STEPS} of {trained[0]}, "), seen


def test_a_tokenizer_other_than_the_runs_is_refused(trained, loaded, capsys):
    """The run trained on the embedded corpus's bytes: GPT-2's ids would be read as bytes, or beyond its 256."""
    refused(capsys, ["--run", trained[0], "--tokenizer", "gpt2", "--prompt", "Hello"],
            f"--tokenizer gpt2 is not the tokenizer of {trained[0]}: its data (the embedded corpus) was tokenized "
            f"with bytes; leave --tokenizer out to use the run's own")
    # Where the run's tokenizer is not known (below), a prompt past the model's vocabulary is still refused.
    with pytest.raises(UserError, match="token id 15496, beyond the model's vocabulary of 256"):
        sample.sample_texts(loaded.params, loaded.model_cfg, "fp32", model_source.tokenizer("gpt2"), "Hello",
                           sample.Sampling())


def test_sampling_in_fp16_and_naming_the_runs_own_tokenizer(trained, capsys):
    """--precision fp16 is accepted (the model computes in fp16, as an fp16 run's own sample does), and so is
    --tokenizer naming the run's own one."""
    sample.main(["--run", trained[0], "--precision", "fp16", "--tokenizer", "bytes", "--prompt", PROMPT,
                 "--max_new_tokens", "20", "--temperature", "0"])
    out, err = capsys.readouterr()
    assert f"step {STEPS} of {trained[0]}, fp16, temperature 0.0" in err
    assert out.startswith(PROMPT) and len(out) > len(PROMPT) + 1 and "\ufffd" not in out, out


def _trained_on(tmp_path, cache_dir, name: str, tokens, vocab_size: int, tokenizer: str) -> tuple[str, str]:
    """(data folder, run folder) of a 4-step run (`python -m jaxtrain.run`) on the data folder tmp_path/name that
    holds `tokens` in both splits."""
    data_dir, out_dir = str(tmp_path / name), str(tmp_path / "run")
    prepare.write_token_dir(data_dir, tokens, tokens, vocab_size, tokenizer)
    proc = subprocess.run([sys.executable, "-m", "jaxtrain.run", *small_args(
        out_dir, cache_dir, f"--data.path={data_dir}", "--train.steps=4", "--train.eval_every=4")],
        capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return data_dir, out_dir


def test_a_gpt2_run_refuses_bytes_while_its_data_is_here_and_takes_a_tokenizer_once_it_is_not(
        tmp_path, cache_dir, capsys):
    """A run on GPT-2 BPE data sampled with --tokenizer bytes printed U+FFFD only, exit 0. Refused while its data
    folder says gpt2; once that folder is gone, --tokenizer is how the sample knows, and bytes is taken as given."""
    tokens = np.random.default_rng(0).integers(0, 50257, 20000, dtype=np.uint16)
    data_dir, out_dir = _trained_on(tmp_path, cache_dir, "bpe", tokens, 50257, "gpt2")
    flags = ["--prompt", "Hello", "--max_new_tokens", "3", "--temperature", "0"]
    refused(capsys, ["--run", out_dir, "--tokenizer", "bytes", *flags],
            f"--tokenizer bytes is not the tokenizer of {out_dir}: its data folder {data_dir} was tokenized with "
            f"gpt2; leave --tokenizer out to use the run's own")
    sample.main(["--run", out_dir, "--tokenizer", "gpt2", *flags, "--stop_at_eot"])  # GPT-2's has one
    assert capsys.readouterr().out.startswith("Hello")
    os.rename(data_dir, data_dir + "-elsewhere")
    refused(capsys, ["--run", out_dir, *flags], f"the run's data folder {data_dir} is not here")
    sample.main(["--run", out_dir, "--tokenizer", "bytes", *flags])
    assert capsys.readouterr().out.startswith("Hello")
    # The folder prepared again, as bytes: its meta.json is no word on the run's tokenizer (it sampled in bytes,
    # exit 0, and --tokenizer gpt2 was refused), so --tokenizer is asked for, and gpt2 taken.
    prepare.write_token_dir(data_dir, tokens % 256, tokens % 256, 256, "bytes")
    refused(capsys, ["--run", out_dir, *flags],
            f"the run's data folder {data_dir} no longer holds the data the run trained on (its data fingerprint "
            f"changed: prepared again since), so its meta.json does not say the run's tokenizer; pass --tokenizer "
            f"bytes or --tokenizer gpt2")
    sample.main(["--run", out_dir, "--tokenizer", "gpt2", *flags])
    assert capsys.readouterr().out.startswith("Hello")


def test_a_relative_data_path_is_named_as_read_from_this_directory(tmp_path, monkeypatch):
    """A run's relative data.path is read from the directory jaxtrain.sample or to-hf runs in: another folder of
    that name there was said to be the run's, prepared again since."""
    tokens = np.arange(200, dtype=np.uint16) % 256
    prepare.write_token_dir(str(tmp_path / "elsewhere" / "data" / "tok"), tokens, tokens, 256, "bytes")
    cfg = config.load(["--config", "configs/tiny.yaml", "--data.path=data/tok", "--model.seq_len=32"])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        run_tokenizer.trained_tokenizer(cfg, "0" * 64)
    assert str(e.value) == (f"the run's data folder data/tok (relative: read from {tmp_path}) is not here to say "
                            f"which tokenizer it used (its meta.json)")
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(UserError) as e:
        run_tokenizer.trained_tokenizer(cfg, "0" * 64)
    assert str(e.value) == (f"the run's data folder data/tok (relative: read from {tmp_path / 'elsewhere'}) no "
                            f"longer holds the data the run trained on (its data fingerprint changed: prepared "
                            f"again since, or another folder than the run's of that name), so its meta.json does "
                            f"not say the run's tokenizer")


def test_a_byte_run_whose_folder_was_prepared_again_as_gpt2_takes_bytes_and_refuses_gpt2(tmp_path, cache_dir,
                                                                                         capsys):
    """The other way round: a byte run (vocab 256) whose data folder now says gpt2 was sampled with GPT-2's BPE
    (its ids below 256 read as other text, exit 0) and refused --tokenizer bytes, its own. Now bytes is taken, the
    same text as before the folder changed, and gpt2, whose 50257 tokens the model has no room for, is refused."""
    tokens = np.frombuffer(b"def forward(self, x):\n    return x\n" * 600, np.uint8)
    data_dir, out_dir = _trained_on(tmp_path, cache_dir, "bytes", tokens, 256, "bytes")
    flags = ["--prompt", "a", "--max_new_tokens", "8", "--temperature", "0"]
    sample.main(["--run", out_dir, *flags])
    before = capsys.readouterr().out
    gpt2_ids = np.random.default_rng(0).integers(0, 50257, 20000, dtype=np.uint16)
    prepare.write_token_dir(data_dir, gpt2_ids, gpt2_ids, 50257, "gpt2")
    refused(capsys, ["--run", out_dir, *flags], f"the run's data folder {data_dir} no longer holds the data")
    refused(capsys, ["--run", out_dir, "--tokenizer", "gpt2", *flags],
            f"--tokenizer gpt2 has 50257 tokens, more than the 256 of the model of {out_dir}: the run was trained "
            f"with another tokenizer; pass --tokenizer bytes")
    sample.main(["--run", out_dir, "--tokenizer", "bytes", *flags])
    assert capsys.readouterr().out == before and before.startswith("a") and len(before) > 2


def test_data_whose_tokenizer_jaxtrain_lacks_trains_and_its_sample_is_refused_before_the_first_step(
        tmp_path, cache_dir, capsys):
    """A data folder whose meta.json names another tokenizer (a character-level one): its ids train as any. The
    end-of-run sample used to read them as GPT-2's after the whole run and exit 2 with a fix no flag gives; now the
    run is refused before its first step, naming log.sample_tokens=0, and `jaxtrain.sample` refuses in one line."""
    tokens = np.random.default_rng(0).integers(0, 65, 20000, dtype=np.uint16)
    data_dir, out_dir = str(tmp_path / "chars"), str(tmp_path / "run")
    prepare.write_token_dir(data_dir, tokens, tokens, 65, "char")
    command = [sys.executable, "-m", "jaxtrain.run", *small_args(
        out_dir, cache_dir, f"--data.path={data_dir}", "--train.steps=4", "--train.eval_every=4")]
    proc = subprocess.run(command + ["--log.sample_tokens=20"], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: the end-of-run sample (log.sample_tokens=20) could not be drawn: the data's tokenizer is 'char', and "
        "jaxtrain encodes and decodes text with bytes or gpt2 only. To train without it, set --log.sample_tokens=0"]
    assert not os.path.exists(os.path.join(out_dir, "checkpoints"))
    proc = subprocess.run(command + ["--log.sample_tokens=0"], capture_output=True, text=True)
    assert proc.returncode == 0 and "done: steps 0->4" in proc.stderr, proc.stderr[-3000:]
    refused(capsys, ["--run", out_dir, "--prompt", "a"],
            f"the data's tokenizer is 'char', and jaxtrain encodes and decodes text with bytes or gpt2 only; sample "
            f"{out_dir} outside jaxtrain, with its data's tokenizer (`python -m jaxtrain.convert to-torch`")


def test_a_meta_json_naming_a_tokenizer_its_vocabulary_cannot_hold_is_refused_before_the_first_step(tmp_path,
                                                                                                      cache_dir):
    """GPT-2 ids below 256 with a meta.json that says gpt2 and vocab_size 256 (hand-written): they train, and the
    end-of-run sample's prompt ("def ", GPT-2 id 4299) had no row in the model: exit 2 after the whole run. Now the
    run is refused before anything is written, naming the meta.json."""
    tokens = np.random.default_rng(0).integers(0, 256, 20000, dtype=np.uint16)
    data_dir, out_dir = str(tmp_path / "gpt2-256"), str(tmp_path / "run")
    prepare.write_token_dir(data_dir, tokens, tokens, 256, "gpt2")
    with pytest.raises(UserError) as e:
        run.train(config.load(small_args(out_dir, cache_dir, f"--data.path={data_dir}", "--log.sample_tokens=20",
                                         "--log.sample_prompt=def ")))
    assert str(e.value) == (
        f"the end-of-run sample (log.sample_tokens=20) could not be drawn: log.sample_prompt encodes to token id "
        f"4299 with the data's tokenizer (gpt2), past the model's 256 rows: {data_dir}/meta.json names a tokenizer "
        f"its vocab_size does not hold; set --log.sample_tokens=0, or fix it before a run's first start (its "
        f"fingerprint, which a resume checks, covers meta.json)")
    assert not os.path.exists(out_dir)


INVALID_FLAGS = st.one_of(
    st.integers(-10**9, 0).map(lambda n: ([f"--max_new_tokens={n}"], "--max_new_tokens must be > 0")),
    st.integers(2**31 - 1, 2**70).map(lambda n: ([f"--max_new_tokens={n}"], "--max_new_tokens must be below")),
    st.floats(max_value=-1e-30).map(lambda t: ([f"--temperature={t!r}"], "--temperature must be")),
    st.sampled_from(["nan", "inf", "-inf"]).map(lambda t: ([f"--temperature={t}"], "--temperature must be")),
    st.integers(-10**9, -1).map(lambda k: ([f"--top_k={k}"], "--top_k must be >= 0")),
    (st.floats(max_value=0) | st.floats(min_value=1, exclude_min=True) | st.just(float("nan"))).map(
        lambda p: ([f"--top_p={p!r}"], "--top_p must be in (0, 1]")),
    (st.integers(-10**9, 0) | st.integers(1025, 10**9)).map(
        lambda n: ([f"--num_samples={n}"], "--num_samples must be in [1, 1024]")),
    (st.integers(-10**9, -1) | st.integers(2**32, 2**70)).map(lambda s: ([f"--seed={s}"], "--seed must be")),
    st.sampled_from(["--max_new_tokens", "--top_k", "--top_p", "--num_samples", "--seed", "--step",
                     "--temperature"]).flatmap(
        lambda flag: st.sampled_from(["x", "1e", "", "--"]).map(lambda v: ([flag, v], flag))),
    st.sampled_from([["--precision", "fp8"], ["--tokenizer", "utf8"], ["--unknown", "1"]]).map(
        lambda args: (args, args[0])),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=INVALID_FLAGS)
def test_invalid_flags_are_refused_in_one_line_before_the_run_is_read(case, capsys, tmp_path):
    args, named = case
    refused(capsys, ["--run", str(tmp_path / "never-read"), *args], named)


def _copy_of(trained, tmp_path) -> tuple[str, str]:
    """A copy of the trained run (steps 20 and 40) to change: (its folder, its checkpoints folder)."""
    run_dir = str(tmp_path / "run")
    shutil.copytree(trained[0], run_dir)
    return run_dir, os.path.join(run_dir, "checkpoints")


def _trainer_replacing_the_newest(monkeypatch, checkpoints: str, times: int) -> None:
    """convert.restore_step as a run still training with checkpoint.max_to_keep makes it, `times` times: while the
    newest step N is read, the run saves N + 20 and deletes N, and orbax's read of N fails."""
    restore, replaced = convert.restore_step, []

    def restore_as_replaced(step_dir, fix, devices, weights_only):
        if len(replaced) < times:
            step = int(os.path.basename(step_dir))
            copy_step(step_dir, step + 20)
            shutil.rmtree(step_dir)
            replaced.append(step)
        return restore(step_dir, fix, devices, weights_only)

    monkeypatch.setattr(convert, "restore_step", restore_as_replaced)


def test_sampling_a_run_that_replaces_its_newest_checkpoint_reads_the_new_newest(trained, loaded, tmp_path,
                                                                                 monkeypatch):
    """Step 40 deleted by the run while it was read: "checkpoint .../40 cannot be read", exit 2. Now the new newest,
    60 (40's arrays), is read."""
    run_dir, checkpoints = _copy_of(trained, tmp_path)
    _trainer_replacing_the_newest(monkeypatch, checkpoints, times=1)
    got = model_source.from_run(run_dir, None, None, "sample")
    assert got.step == 60 and sorted(os.listdir(checkpoints), key=int) == ["20", "60"]
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(loaded.params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_run_that_keeps_replacing_its_newest_checkpoint_is_named_still_training(trained, tmp_path, monkeypatch,
                                                                                  capsys):
    run_dir, checkpoints = _copy_of(trained, tmp_path)
    _trainer_replacing_the_newest(monkeypatch, checkpoints, times=model_source.RESTORE_TRIES)
    refused(capsys, ["--run", run_dir], f"{run_dir} is still training and replaced its newest checkpoint while it "
                                        f"was read, 3 times; raise its checkpoint.max_to_keep")
    assert sorted(os.listdir(checkpoints), key=int) == ["20", "100"]  # 40 -> 60 -> 80 -> 100


def test_weights_too_big_for_the_devices_are_refused_at_once_though_the_run_replaced_them(trained, tmp_path,
                                                                                          monkeypatch, capsys):
    """XLA's RESOURCE_EXHAUSTED as step 40 is read, while the run saves 60 and deletes 40: the next newest is no
    smaller, so the refusal is the memory's at once, not 60 and 80 read in turn and the run "still training"."""
    run_dir, checkpoints = _copy_of(trained, tmp_path)

    def out_of_memory(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4096 bytes.")
    monkeypatch.setattr(convert.ocp.PyTreeCheckpointHandler, "restore", out_of_memory)
    _trainer_replacing_each_read(monkeypatch)
    refused(capsys, ["--run", run_dir], f"checkpoint {run_dir}/checkpoints/40 needs more memory than a device has "
                                        f"to be read")
    assert sorted(os.listdir(checkpoints), key=int) == ["20", "60"]


def test_flags_the_devices_rule_refuses_are_refused_at_once_though_the_run_replaced_them(trained, tmp_path,
                                                                                         monkeypatch):
    """The rule that picks the devices from the run's config (evaluate's) refusing the command's flags as step 40
    is read, while the run saves 60 and deletes 40: no other checkpoint mends the flags, so the refusal is the
    rule's at once, not 60 and 80 read in turn."""
    run_dir, checkpoints = _copy_of(trained, tmp_path)

    def no_part(run):
        raise UserError("--batch_size 9 is not divisible by --micro_batches 2")
    _trainer_replacing_each_read(monkeypatch)
    with pytest.raises(UserError, match="^--batch_size 9 is not divisible by --micro_batches 2$"):
        model_source.from_run(run_dir, None, None, "evaluate", no_part)
    assert sorted(os.listdir(checkpoints), key=int) == ["20", "60"]


def _trainer_replacing_each_read(monkeypatch) -> None:
    """convert.restore_step as a run still training makes it where each read fails: meanwhile the run saves the
    newest step N + 20 and deletes N."""
    restore = convert.restore_step

    def replaced_meanwhile(step_dir, fix, devices, weights_only):
        try:
            return restore(step_dir, fix, devices, weights_only)
        finally:
            copy_step(step_dir, int(os.path.basename(step_dir)) + 20)
            shutil.rmtree(step_dir)
    monkeypatch.setattr(convert, "restore_step", replaced_meanwhile)


def test_a_corrupt_newest_checkpoint_still_listed_is_named_corrupt_not_still_training(trained, tmp_path, capsys):
    """One checksum off in step 40's meta (a flipped bit in its weights): 40 is still the newest after the read."""
    run_dir, checkpoints = _copy_of(trained, tmp_path)
    meta_file = os.path.join(checkpoints, "40", "meta", "metadata")
    with open(meta_file) as f:
        meta = json.load(f)
    array = next(path for path in sorted(meta["fingerprint"]) if path.startswith("params/"))  # one sample reads
    meta["fingerprint"][array] += 1
    with open(meta_file, "w") as f:
        json.dump(meta, f)
    refused(capsys, ["--run", run_dir], f"checkpoint {os.path.join(checkpoints, '40')} does not match its "
                                        f"fingerprint: {array}")
    refused(capsys, ["--run", run_dir], "it is corrupt; sample another of its checkpoints with --step (20)")
