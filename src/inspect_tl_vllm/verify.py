"""``tl-vllm verify``: a self-check of the instrumented engine on this machine (GPU or CPU).

    tl-vllm verify [--model smollm2] [--requests N] [--max-tokens T] [--dtype float32] [--eager | --compiled]
    python -m inspect_tl_vllm.verify ...   (the same)

Boots the instrumented engine as ``inspect_tl_vllm.boot`` does (on a GPU: torch.compile and CUDA
graphs; on vLLM's CPU build: eager) and prints one ``PASS name: detail`` or ``FAIL name: detail``
line per check, then a summary; exits 1 if a check failed, 2 on bad arguments.

- environment: the vLLM release (a supported one), platform, model runner (V1/V2), compilation and
  CUDA-graph mode (the mode asked for).
- hooks_fire: every hook site's counter advances on every forward step of a generation (under CUDA
  graph replay on a compiled GPU engine).
- isolation: N concurrent requests, each steered by its own random vector at its own layer (every
  eighth unsteered), give the tokens and final-norm rows of their runs alone (rows compared up to
  the first token where greedy decoding went another way), and steps carried several of them.
- compiled_vs_eager (compiled engines only): a second engine booted eager gives the same steered
  and unsteered captures and greedy tokens.
- steering: the steered capture downstream of the steered layer equals transformers' forward with
  the same vector added to that decoder layer's output by a torch forward hook, and the engine's
  greedy tokens are transformers' argmax (near ties allowed).
- fidelity: unsteered captures (resid_pre 0, resid_post of two layers, ln_final.hook_normalized)
  equal transformers' hidden states, and the tokens its argmax.

Float32 (the default) compares at a relative error of 1e-3 on the CPU and 5e-3 on a GPU (isolation,
batched against solo runs whose GPU kernels tile differently: 1e-2); bfloat16 at 5e-2, with token
equality reported but not required (its kernels round differently).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary colour.",
    "What is 2 + 2?",
    "Who wrote Hamlet?",
    "Give me a word that rhymes with cat.",
    "What is the boiling point of water?",
    "How many legs does a spider have?",
    "What colour is the sky on a clear day?",
]
FINAL = "ln_final.hook_normalized"
MAX_MODEL_LEN = 512
REQUESTS = {"gpu": 64, "cpu": 16}
REQUESTS_RANGE = (2, 1024)
MAX_TOKENS_RANGE = (2, 256)
TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2}
GPU_FLOAT32_TOLERANCE = 5e-3
"""Float32 against transformers on a GPU: vLLM's GPU kernels (attention, fused norms) round
differently from transformers', and the error grows with depth (SmolLM2 on an H100, vLLM 0.20.2:
1.2e-4 at layer 15, 1.1e-3 at layer 29, 1.9e-3 after the final norm); a steering effect is 10x this."""
# A batch and a lone request run different GEMM tilings on a GPU, so their float32 rows drift apart
# as decoding goes on (up to 1.1e-3 after 64 tokens on an H100, vLLM 0.20.2, both runners). A leaked
# vector (each is half the median residual norm) moves final-norm rows by tenths, far above these.
ISOLATION_TOLERANCE = {"float32": 1e-2, "bfloat16": 5e-2}
UNSTEERED_EVERY = 8  # in the isolation batch, every eighth request carries a capture only


@dataclass
class Check:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} {self.name}: {self.detail}"


class NotRun(Exception):
    """A check whose inputs an earlier step failed to produce."""


def say(message: str) -> None:
    print(f"verify: {message}", flush=True)


def rel(a: Any, b: Any) -> float:
    """Relative error of ``a`` against ``b`` (Frobenius norms)."""
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


# --------------------------------------------------------------------------------------------
# The checks, on plain data (tests feed them mismatching data)


def check_environment(
    *,
    release: str | None,
    unsupported: str | None,
    platform: str,
    runner: str,
    compilation: str,
    cudagraphs: str,
    async_scheduling: bool,
    want_compiled: bool,
    on_cpu: bool,
) -> Check:
    """The vLLM release is supported, the runner is one the package instruments, and the engine
    runs in the mode asked for (compiled: torch.compile, and on a GPU CUDA graphs; eager: neither)."""
    mode = "compiled" if want_compiled else "eager"
    if want_compiled != on_cpu:
        mode += f", the {'CPU' if on_cpu else 'GPU'} default"
    detail = (
        f"vLLM {release}, {platform}, model runner {runner}, compilation {compilation}, CUDA graphs {cudagraphs}, "
        f"async scheduling {'on' if async_scheduling else 'off'} ({mode})"
    )
    problems = []
    if unsupported:
        problems.append(unsupported)
    if runner not in ("V1", "V2"):
        problems.append(f"unknown model runner {runner!r}")
    if want_compiled and compilation == "NONE":
        problems.append("the engine was asked to compile but runs without torch.compile")
    if want_compiled and not on_cpu and cudagraphs == "NONE":
        problems.append("the engine was asked to compile but runs without CUDA graphs")
    if not want_compiled and (compilation != "NONE" or cudagraphs != "NONE"):
        problems.append("the engine was asked to run eager but compiles")
    return Check("environment", not problems, "; ".join([*problems, detail]))


def check_hooks_fired(sites: Sequence[str], before: Sequence[int], after: Sequence[int], steps: int, how: str) -> Check:
    """Every site's fire counter advanced at least once per forward step of the generation."""
    how = f" {how}" if how else ""
    if len(sites) != len(before) or len(before) != len(after) or not sites:
        return Check("hooks_fire", False, f"status lists {len(sites)} sites, {len(before)}/{len(after)} counters")
    increases = [b - a for a, b in zip(before, after, strict=True)]
    short = [f"{site} (+{n})" for site, n in zip(sites, increases, strict=True) if n < steps]
    if short:
        return Check(
            "hooks_fire",
            False,
            f"{len(short)} of {len(sites)} sites fired fewer than {steps} times over {steps} forward steps{how}: "
            f"{', '.join(short[:5])}{' ...' if len(short) > 5 else ''}",
        )
    return Check(
        "hooks_fire",
        True,
        f"all {len(sites)} hook sites fired on each of the {steps} forward steps{how} (at least +{min(increases)})",
    )


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The index of the first differing token, or the shorter length."""
    return next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))


def check_isolation(
    together: Sequence[Any],
    alone: Sequence[Any],
    hook: str,
    tolerance: float,
    steered_in_one_step: int,
    *,
    strict_tokens: bool,
) -> Check:
    """Concurrent requests equal their solo runs: the same tokens (90% of them under strict
    tokens; batched and solo kernels may round a near tie apart on a GPU), and the same captured
    rows up to the first token where greedy decoding differed; a step carried several of them."""
    n = len(together)
    same, worst, where = 0, 0.0, ""
    for i, (joint, solo) in enumerate(zip(together, alone, strict=True)):
        same += joint.token_ids == solo.token_ids
        common = first_difference(joint.token_ids, solo.token_ids)
        a_rows, b_rows = joint.activations[hook], solo.activations[hook]
        rows = min(len(solo.prompt_token_ids) + common, len(a_rows), len(b_rows))
        err = rel(a_rows[:rows], b_rows[:rows])
        if err > worst:
            worst, where = err, f" (request {i})"
    wanted = min(n, 3)
    detail = (
        f"{same}/{n} concurrent requests gave their solo run's tokens; {hook} rows equal up to the first "
        f"differing token (max rel err {worst:.1e}{where}, tolerance {tolerance:g}); up to {steered_in_one_step} "
        "differently steered requests in one step"
    )
    problems = []
    if worst > tolerance:
        problems.append("captured rows differ from the solo runs")
    if strict_tokens and same < 0.9 * n:
        problems.append("tokens differ from the solo runs")
    if steered_in_one_step < wanted:
        problems.append(f"no step carried {wanted} differently steered requests")
    return Check("isolation", not problems, "; ".join([*problems, detail]))


def compare_captures(got: dict[str, Any], want: dict[str, Any]) -> dict[str, float]:
    """Relative error per hook point; a shape mismatch is an infinite error."""
    errors = {}
    for hook, value in want.items():
        mine = got.get(hook)
        errors[hook] = float("inf") if mine is None or tuple(mine.shape) != tuple(value.shape) else rel(mine, value)
    return errors


def greedy_agreement(token_ids: Sequence[int], prompt_len: int, logits: Any, tolerance: float) -> tuple[int, int]:
    """How many generated tokens are the reference's argmax, near ties counted as agreeing: a
    token whose reference logit is within ``tolerance`` (relative) of the top one."""
    agree = 0
    for k, token in enumerate(token_ids):
        row = logits[prompt_len - 1 + k]
        best = float(row.max())
        agree += best - float(row[token]) <= tolerance * max(1.0, abs(best))
    return agree, len(token_ids)


def _errors_text(errors: dict[str, float]) -> str:
    return ", ".join(f"{_short(hook)}: {err:.1e}" for hook, err in errors.items())


def _short(hook: str) -> str:
    """blocks.15.hook_resid_post -> resid_post 15; ln_final.hook_normalized -> ln_final."""
    match = re.match(r"blocks\.(\d+)\.hook_(\w+)", hook)
    short = f"{match[2]} {match[1]}{hook[match.end() :]}" if match else hook
    return short.replace(FINAL, "ln_final")


def check_against_reference(
    name: str,
    errors: dict[str, float],
    tokens: tuple[int, int],
    tolerance: float,
    *,
    strict_tokens: bool,
    what: str,
    effect: float | None = None,
) -> Check:
    """Captures within ``tolerance`` of the reference, and (strict) every token its argmax; for
    steering, ``effect`` (how far the steering moved the capture) must be far above the tolerance."""
    agree, total = tokens
    problems = []
    bad = {hook: err for hook, err in errors.items() if not err <= tolerance}
    if bad:
        problems.append(f"{_errors_text(bad)} above {tolerance:g}")
    if strict_tokens and agree < total:
        problems.append(f"{total - agree} of {total} greedy tokens are not the reference's argmax")
    if effect is not None and not effect > 10 * tolerance:
        problems.append(f"the steering moved ln_final by only {effect:.1e}: it did not act")
    detail = f"{what}: rel err {_errors_text(errors)} (tolerance {tolerance:g}); {agree}/{total} greedy tokens agree"
    if effect is not None:
        detail += f"; the steering moved ln_final by {effect:.0%}"
    return Check(name, not problems, "; ".join([*problems, detail]))


# --------------------------------------------------------------------------------------------
# The transformers reference


def load_reference_model(path: str, dtype: str, device: str) -> Any:
    """transformers' model on the same weights, in ``dtype`` on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()


def _decoder(model: Any) -> tuple[Any, Any]:
    """transformers' decoder layers and final norm."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers, norm = getattr(decoder, "layers", None), getattr(decoder, "norm", None)
    if layers is None or norm is None:
        raise RuntimeError(f"{type(model).__name__}: cannot find its decoder layers and final norm")
    return layers, norm


def reference_forward(
    model: Any, token_ids: list[int], hooks: Sequence[str], steer: tuple[int, Any, float] | None = None
) -> tuple[dict[str, Any], Any]:
    """transformers' values at ``hooks`` (blocks.N.hook_resid_pre / hook_resid_post = the input /
    output of decoder layer N, ln_final.hook_normalized = the final norm's output) and the logits,
    for one forward over ``token_ids``; ``steer`` = (layer, vector, coef) adds coef * vector to the
    output of that decoder layer at every position."""
    import torch

    layers, norm = _decoder(model)
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    acts: dict[str, torch.Tensor] = {}

    def first(x: Any) -> torch.Tensor:
        return x[0] if isinstance(x, tuple) else x

    def keep(hook: str) -> Callable:
        return lambda module, args, out: acts.__setitem__(hook, first(out)[0])

    def keep_input(hook: str) -> Callable:
        return lambda module, args, kwargs: acts.__setitem__(hook, (args[0] if args else kwargs["hidden_states"])[0])

    handles = []
    if steer is not None:
        layer, vector, coef = steer
        delta = (coef * torch.as_tensor(vector, dtype=torch.float32)).to(device=device, dtype=dtype)

        def add(module: Any, args: Any, out: Any) -> Any:
            return (out[0] + delta, *out[1:]) if isinstance(out, tuple) else out + delta

        handles.append(layers[layer].register_forward_hook(add))
    for hook in hooks:
        match = re.fullmatch(r"blocks\.(\d+)\.hook_resid_(pre|post)", hook)
        if hook == FINAL:
            handles.append(norm.register_forward_hook(keep(hook)))
        elif match and match[2] == "pre":
            handles.append(layers[int(match[1])].register_forward_pre_hook(keep_input(hook), with_kwargs=True))
        elif match:
            handles.append(layers[int(match[1])].register_forward_hook(keep(hook)))
        else:
            raise ValueError(f"no transformers reference for hook point {hook!r}")
    try:
        with torch.no_grad():
            logits = model(torch.tensor([token_ids], device=device)).logits[0]
    finally:
        for handle in handles:
            handle.remove()
    return {hook: value.float().cpu() for hook, value in acts.items()}, logits.float().cpu()


# --------------------------------------------------------------------------------------------
# Running it


def _bounded(low: int, high: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range; give {low} to {high} {what}")
        return value

    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is out of range; give a fraction in (0, 1]")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``tl-vllm verify`` (and ``python -m inspect_tl_vllm.verify``)."""
    parser.add_argument("--model", default="smollm2", help="alias, local model folder or Hugging Face id")
    parser.add_argument(
        "--requests",
        type=_bounded(*REQUESTS_RANGE, "requests"),
        default=None,
        help=f"concurrent steered requests in the isolation check (default {REQUESTS['gpu']} on a GPU, "
        f"{REQUESTS['cpu']} on the CPU; {REQUESTS_RANGE[0]} to {REQUESTS_RANGE[1]})",
    )
    parser.add_argument(
        "--max-tokens",
        type=_bounded(*MAX_TOKENS_RANGE, "tokens"),
        default=16,
        help=f"tokens generated per request (default 16; {MAX_TOKENS_RANGE[0]} to {MAX_TOKENS_RANGE[1]})",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(TOLERANCE),
        help="engine and reference dtype (float32: strict, rel err 1e-3 or 5e-3 on a GPU, isolation 1e-2, equal "
        "tokens; bfloat16: 5e-2)",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--eager", action="store_true", help="boot the engine eager (the CPU default)")
    mode.add_argument(
        "--compiled",
        action="store_true",
        help="boot it compiled (the GPU default: torch.compile and CUDA graphs); also compare it with an eager one",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        default=0.4,
        help="fraction of GPU memory each engine may take (default 0.4: with --compiled an eager engine runs "
        "beside the compiled one)",
    )
    parser.add_argument("--verbose", action="store_true", help="keep vLLM's and transformers' own logging")


@contextlib.contextmanager
def environment(**values: str | None) -> Iterator[None]:
    """Environment variables set (None: removed) while the block runs, then restored."""
    saved = {key: os.environ.get(key) for key in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclass
class Plan:
    """Which layers and hook points the checks use, for a model of ``layers`` layers."""

    layers: int

    @property
    def steer_layer(self) -> int:
        return self.layers // 3

    @property
    def steer_hook(self) -> str:
        return f"blocks.{self.steer_layer}.hook_resid_post"

    @property
    def downstream(self) -> list[str]:
        """Captures downstream of the steered layer (the steering check)."""
        later = max(self.steer_layer + 1, (2 * self.layers) // 3)
        return [*([f"blocks.{later}.hook_resid_post"] if later < self.layers else []), FINAL]

    @property
    def fidelity(self) -> list[str]:
        middle, last = self.layers // 2, self.layers - 1
        return ["blocks.0.hook_resid_pre", *dict.fromkeys([f"blocks.{middle}.hook_resid_post",
                f"blocks.{last}.hook_resid_post"]), FINAL]  # fmt: skip


class Verifier:
    """The checks in order, on engines booted one at a time; results go into ``checks``."""

    def __init__(self, args: argparse.Namespace, path: str, on_cpu: bool) -> None:
        self.args = args
        self.path = path
        self.on_cpu = on_cpu
        self.compiled = args.compiled or (not args.eager and not on_cpu)
        self.requests = args.requests or REQUESTS["cpu" if on_cpu else "gpu"]
        self.max_tokens = args.max_tokens
        self.tolerance = GPU_FLOAT32_TOLERANCE if args.dtype == "float32" and not on_cpu else TOLERANCE[args.dtype]
        self.isolation_tolerance = ISOLATION_TOLERANCE[args.dtype]
        self.strict_tokens = args.dtype == "float32"
        self.checks: list[Check] = []
        self.prompt: Any = None
        self.plain: Any = None  # the unsteered generation (captures of the fidelity hooks)
        self.steered: Any = None  # the steered generation (captures downstream)
        self.steer_vector: Any = None
        self.plan: Plan | None = None

    def add(self, check: Check) -> None:
        self.checks.append(check)
        print(check.line(), flush=True)

    def attempt(self, name: str, step: Callable[[], Check]) -> None:
        """Run one check; an exception is that check's failure, and the others still run."""
        try:
            self.add(step())
        except NotRun as why:
            self.add(Check(name, False, f"not run: {why}"))
        except Exception as err:
            self.add(Check(name, False, f"{type(err).__name__}: {err}"))

    # engines ----------------------------------------------------------------------------

    def boot(self, compiled: bool) -> Any:
        from inspect_tl_vllm.engine.offline import boot

        settings: dict[str, Any] = {
            "dtype": self.args.dtype,
            "max_model_len": MAX_MODEL_LEN,
            "enforce_eager": not compiled,
        }
        if not self.on_cpu:
            settings["gpu_memory_utilization"] = self.args.gpu_memory_utilization
        instrument = {"max_vectors": max(256, self.requests + 16)}  # the default hook points
        mode = "eager" if not compiled else "compiled" if self.on_cpu else "compiled (torch.compile + CUDA graphs)"
        say(f"booting the instrumented engine on {self.args.model}, {self.args.dtype}, {mode} ...")
        started = time.perf_counter()
        # The engine's processes are spawned, not forked: an engine core forked from this process once
        # the first engine's threads ran hung at boot on a GPU (vLLM 0.20.2, both runners). On the CPU
        # an eager engine also skips the sampler's own torch.compile (C++ builds there).
        overrides = {"VLLM_WORKER_MULTIPROC_METHOD": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "spawn")}
        if self.on_cpu and not compiled:
            overrides["TORCH_COMPILE_DISABLE"] = "1"
        with environment(**overrides):
            engine = boot(self.path, instrument=instrument, **settings)
        say(f"booted in {time.perf_counter() - started:.0f} s")
        return engine

    @staticmethod
    def shutdown(engine: Any) -> None:
        with contextlib.suppress(Exception):
            engine.llm.llm_engine.engine_core.shutdown()

    def generate_pair(self, engine: Any) -> tuple[Any, Any]:
        """The unsteered generation (fidelity captures and the steering layer's rows) and the steered one."""
        assert self.plan is not None
        hooks = list(dict.fromkeys([*self.plan.fidelity, self.plan.steer_hook]))
        plain = engine.generate(
            [self.prompt], specs=[{"capture": {"hooks": hooks}}], max_tokens=self.max_tokens, ignore_eos=True
        )[0]
        if self.steer_vector is None:
            self.steer_vector = self.random_vectors(1, plain.activations[self.plan.steer_hook], seed=1)[0]
        spec = {
            "interventions": [{"hook": self.plan.steer_hook, "vector": self.steer_vector, "coef": 2.0}],
            "capture": {"hooks": self.plan.downstream},
        }
        steered = engine.generate([self.prompt], specs=[spec], max_tokens=self.max_tokens, ignore_eos=True)[0]
        return plain, steered

    @staticmethod
    def random_vectors(count: int, rows: Any, seed: int) -> list[list[float]]:
        """Random directions at half the median norm of ``rows`` (the unsteered residual stream at
        the steered layer, the first row left out), so that coef 2 moves it by about its own size."""
        import torch

        norms = rows[1:].float().norm(dim=-1) if len(rows) > 1 else rows.float().norm(dim=-1)
        scale = 0.5 * float(norms.median())
        generator = torch.Generator().manual_seed(seed)
        vectors = torch.randn(count, rows.shape[-1], generator=generator)
        vectors = vectors / vectors.norm(dim=-1, keepdim=True) * scale
        return vectors.tolist()

    # the steps ----------------------------------------------------------------------------

    def run(self) -> None:
        from inspect_tl_vllm.engine.plugin import installed_vllm, unsupported_vllm

        release = installed_vllm()
        try:
            engine = self.boot(self.compiled)
        except Exception as err:
            why = f"vLLM {release}: the engine did not boot: {type(err).__name__}: {err}"
            self.add(Check("environment", False, why))
            for name in ("hooks_fire", "isolation", "steering", "fidelity"):
                self.add(Check(name, False, "not run: the engine did not boot"))
            return
        try:
            self.prompt = self.chat(engine, QUESTIONS[0])
            self.plan = Plan(engine.core.instrumentation.num_layers)
            self.attempt("environment", lambda: self.environment(engine, release, unsupported_vllm()))
            self.attempt("hooks_fire", lambda: self.hooks_fire(engine))
            self.attempt("isolation", lambda: self.isolation(engine))
            # The eager engine runs beside the compiled one (each takes --gpu-memory-utilization).
            if self.compiled:
                self.attempt("compiled_vs_eager", self.compiled_vs_eager)
            else:
                say("compiled_vs_eager: not run, the engine is eager (--compiled compares a compiled engine with it)")
        finally:
            self.shutdown(engine)
        reference: dict[str, Any] = {}
        self.attempt("steering", lambda: self.steering(reference))
        self.attempt("fidelity", lambda: self.fidelity(reference))

    @staticmethod
    def chat(engine: Any, question: str) -> Any:
        """A chat prompt, or the plain text for a model without a chat template."""
        has_template = getattr(engine.tokenizer, "chat_template", None)
        return [{"role": "user", "content": question}] if has_template else question

    def environment(self, engine: Any, release: str | None, unsupported: str | None) -> Check:
        config = engine.llm.llm_engine.vllm_config
        compilation = config.compilation_config

        def name(value: Any) -> str:
            return str(getattr(value, "name", value))

        platform = "CPU"
        if not self.on_cpu:
            from vllm.platforms import current_platform

            platform = f"CUDA ({current_platform.get_device_name(0)})"
        return check_environment(
            release=release,
            unsupported=unsupported,
            platform=platform,
            runner=str(engine.status()["runner"]),
            compilation=name(getattr(compilation, "mode", getattr(compilation, "level", "?"))),
            cudagraphs=name(getattr(compilation, "cudagraph_mode", "?")),
            async_scheduling=bool(getattr(config.scheduler_config, "async_scheduling", False)),
            want_compiled=self.compiled,
            on_cpu=self.on_cpu,
        )

    def hooks_fire(self, engine: Any) -> Check:
        say(f"generating {self.max_tokens} tokens unsteered, then steered at {self.plan.steer_hook} ...")
        before = engine.status()
        self.plain, self.steered = self.generate_pair(engine)
        after = engine.status()
        steps = len(self.plain.token_ids) + len(self.steered.token_ids)  # two calls, one forward per token
        how = "under CUDA graphs" if self.compiled and not self.on_cpu else "(eager)" if not self.compiled else ""
        return check_hooks_fired(before["sites"], before["fired"], after["fired"], steps, how)

    def isolation(self, engine: Any) -> Check:
        if self.plain is None:
            raise NotRun("the unsteered generation failed")
        n, layers = self.requests, self.plan.layers
        default = " (the CPU default; --requests to change)" if self.args.requests is None and self.on_cpu else ""
        say(f"{n} concurrent requests{default}, each steered by its own random vector, then each alone ...")
        vectors = self.random_vectors(n, self.plain.activations[self.plan.steer_hook], seed=2)
        specs = []
        for i in range(n):
            steering = [] if i % UNSTEERED_EVERY == UNSTEERED_EVERY - 1 else [
                {"hook": f"blocks.{(i * 7) % layers}.hook_resid_post", "vector": vectors[i], "coef": 1.0 + (i % 3) / 2}
            ]  # fmt: skip
            specs.append({"interventions": steering, "capture": {"hooks": [FINAL]}})
        prompts = [self.chat(engine, QUESTIONS[i % len(QUESTIONS)]) for i in range(n)]
        engine.status()  # restarts the count of steered requests per step
        started = time.perf_counter()
        together = engine.generate(prompts, specs=specs, max_tokens=self.max_tokens)
        mixed = engine.status()["max_requests_steered_in_one_step"]
        batch_s = time.perf_counter() - started
        started = time.perf_counter()
        alone = [
            engine.generate([prompt], specs=[spec], max_tokens=self.max_tokens)[0]
            for prompt, spec in zip(prompts, specs, strict=True)
        ]
        say(f"together {batch_s:.1f} s, one by one {time.perf_counter() - started:.1f} s")
        tolerance = self.isolation_tolerance
        return check_isolation(together, alone, FINAL, tolerance, mixed, strict_tokens=self.strict_tokens)

    def compiled_vs_eager(self) -> Check:
        if self.plain is None:
            raise NotRun("the compiled engine's generations failed")
        engine = self.boot(compiled=False)
        try:
            plain, steered = self.generate_pair(engine)
        finally:
            self.shutdown(engine)
        errors = {}
        for label, compiled, eager in (("unsteered", self.plain, plain), ("steered", self.steered, steered)):
            for hook, err in compare_captures(compiled.activations, eager.activations).items():
                errors[f"{hook} ({label})"] = err
        same = [self.plain.token_ids == plain.token_ids, self.steered.token_ids == steered.token_ids]
        bad = {hook: err for hook, err in errors.items() if not err <= self.tolerance}
        problems = [f"{_short(hook)} rel err {err:.1e}" for hook, err in bad.items()]
        if self.strict_tokens and not all(same):
            problems.append("greedy tokens differ")
        worst = max(errors.values())
        detail = (
            f"compiled and eager engines: max rel err {worst:.1e} over {len(errors)} captures (tolerance "
            f"{self.tolerance:g}); tokens {'equal' if all(same) else 'differ'} (unsteered, steered)"
        )
        return Check("compiled_vs_eager", not problems, "; ".join([*problems, detail]))

    def reference_model(self, reference: dict[str, Any]) -> Any:
        if "model" not in reference:
            device = "cpu" if self.on_cpu else "cuda"
            say(f"loading the transformers reference ({self.args.dtype} on {device}) ...")
            reference["model"] = load_reference_model(self.path, self.args.dtype, device)
        return reference["model"]

    def steering(self, reference: dict[str, Any]) -> Check:
        if self.steered is None:
            raise NotRun("the steered generation failed")
        model = self.reference_model(reference)
        out, plan = self.steered, self.plan
        tokens = out.prompt_token_ids + out.token_ids[:-1]
        steer = (plan.steer_layer, self.steer_vector, 2.0)
        acts, logits = reference_forward(model, tokens, plan.downstream, steer=steer)
        unsteered, _ = reference_forward(model, tokens, [FINAL])
        effect = rel(out.activations[FINAL], unsteered[FINAL])
        return check_against_reference(
            "steering",
            compare_captures(out.activations, acts),
            greedy_agreement(out.token_ids, len(out.prompt_token_ids), logits, self.tolerance),
            self.tolerance,
            strict_tokens=self.strict_tokens,
            what=f"steered at {plan.steer_hook} (coef 2) vs transformers with the vector added there",
            effect=effect,
        )

    def fidelity(self, reference: dict[str, Any]) -> Check:
        if self.plain is None:
            raise NotRun("the unsteered generation failed")
        model = self.reference_model(reference)
        out = self.plain
        acts, logits = reference_forward(model, out.prompt_token_ids + out.token_ids[:-1], self.plan.fidelity)
        return check_against_reference(
            "fidelity",
            compare_captures({h: out.activations[h] for h in self.plan.fidelity}, acts),
            greedy_agreement(out.token_ids, len(out.prompt_token_ids), logits, self.tolerance),
            self.tolerance,
            strict_tokens=self.strict_tokens,
            what="unsteered captures vs transformers' hidden states",
        )


def run(args: argparse.Namespace) -> int:
    """Run every check; 0 if all passed, 1 if one failed, 2 for a model that cannot be found."""
    started = time.perf_counter()
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from inspect_tl_vllm.aliases import resolve_model
    from inspect_tl_vllm.specs import SpecError

    try:
        path = resolve_model(args.model)
    except (SpecError, FileNotFoundError) as err:
        print(f"verify: {err}", file=sys.stderr)
        return 2
    from inspect_tl_vllm.engine.construct import on_cpu_build
    from inspect_tl_vllm.engine.plugin import installed_vllm

    on_cpu = on_cpu_build()
    verifier = Verifier(args, path, on_cpu)
    where = "CPU (vLLM's CPU build)" if on_cpu else "GPU"
    say(
        f"vLLM {installed_vllm()} on the {where}; model {args.model} ({path}); {args.dtype}; "
        f"{'compiled' if verifier.compiled else 'eager'} engine; {verifier.requests} concurrent requests"
        f"{' (the CPU default; 64 on a GPU)' if on_cpu and args.requests is None else ''}, "
        f"{verifier.max_tokens} tokens each"
    )
    verifier.run()
    failed = [check.name for check in verifier.checks if not check.ok]
    total, seconds = len(verifier.checks), time.perf_counter() - started
    if failed:
        say(f"{len(failed)} of {total} checks FAILED ({', '.join(failed)}) in {seconds:.0f} s")
        return 1
    say(f"all {total} checks passed in {seconds:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m inspect_tl_vllm.verify",
        description="Self-check of the instrumented engine: hooks, steering, isolation, fidelity.",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # vLLM's spawned processes re-import __main__: run nothing then
    sys.exit(main())
