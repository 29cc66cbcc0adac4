"""Engine-level throughput: vanilla vLLM against the instrumented engine, measured in one run.

    python bench/throughput.py --model smollm2 --prompts 256 --new-tokens 256 --runs 5 --out r.json
    python bench/throughput.py --model llama8b-shape --weights scaled ...   # Llama-3-8B shapes, random weights

``--model`` takes an alias, a path, or a shape from ``SHAPES`` (``llama8b-shape``,
``llama1b-shape``, ``gemma2b-shape``): a config.json with that model's dimensions and SmolLM2's
tokenizer, loaded with vLLM's dummy weights (``--weights scaled`` re-draws them at
training-init scale, ``scaled_weights.py``), so no weights are downloaded.  (Gemma's norms
multiply by 1 + weight, so with the norm weights of 1 that ``scaled`` sets they scale by 2.)

Engines live side by side on the device, each in its own process with the same engine
settings and the same share of GPU memory: vanilla vLLM with every plugin excluded
(``VLLM_PLUGINS=""``) and the instrumented engine from ``construct_instrumented_llm``.
Variants, all on the same chat prompts with fixed output lengths (``ignore_eos``):

1. ``vanilla``     plain vLLM 0.20.2
2. ``plain``       instrumented engine, nothing requested
3. ``steer``       every request steered with its own vector (a torch tensor) at one layer
4. ``capture``     every request captures one hook point, mean over the sample
5. ``capture_all`` every request captures the residual stream of every layer, per prompt token

and, only when named in ``--variants``:

- ``steer_list``: ``steer`` with each vector given as a list of numbers (as a JSON or YAML spec
  gives it), which the front end parses, checks and packs once per request.
- ``steer_zero``: ``steer``'s requests with coefficient 0.  The hooks, tables, vector bank and
  receipts do all of ``steer``'s work, but the outputs stay ``plain``'s, so the difference
  between the two steer variants is what changing the outputs costs (a random-weight model's
  greedy outputs are nearly constant).
- ``capture_all_disk`` and ``capture_all_s3``: ``capture_all``, then every request's activations
  stored as the provider stores a sample (``write_sample`` into 256 MiB shards, four writer
  threads as the provider's ``asyncio.to_thread``, then ``close_writer`` as at the end of an eval)
  in a local folder under ``--scratch``, or in a bucket of a moto S3 server that this script starts
  on localhost (``storage_remote.Server``: moto in a process of its own; ``moto[server]`` and
  ``s3fs`` needed), through s3fs. The time counted runs from
  the first request to the last shard stored, so the ratio includes storing; here storing starts
  when the whole batch has finished, where the provider stores each sample as it finishes, so it
  is the worse case. What was stored is removed after each run, untimed.
- ``sae_steer``, ``sae_clamp`` and ``sae_capture``: a JumpReLU SAE of 65,536 features at
  ``blocks.{L//2}.hook_resid_post`` with random weights (written once under ``--scratch`` in
  SAELens' format, bfloat16).  ``sae_steer`` adds feature ``k % 64`` to request k (coef 4, the
  receipt reporting the feature before and after), ``sae_clamp`` clamps it to 4,
  ``sae_capture`` captures every request's top 32 features per token, prompt and answer, and
  ``sae_capture_prompt`` the same over the prompt only, and ``sae_capture_mean`` the top 32 of
  the mean features over the answer (one row per request).
- ``capture_tokens``: every request captures ``blocks.{L//2}.hook_resid_post`` per token, prompt
  and answer, in bfloat16: ``sae_capture``'s rows without the SAE.
- ``hotwire``: the peer project hotwire-vllm (a vLLM general plugin that steers inside CUDA
  graphs; it does not capture) doing ``steer``'s work in a third engine process, the only one
  with ``--hotwire-dir`` on its path and ``VLLM_PLUGINS=hotwire``.  Each request names its own
  vector (``steer``'s vectors, written as files for ``HOTWIRE_VECTORS``) at layer N = L // 2,
  scale 1, every position, in ``SamplingParams.extra_args["hotwire"]``.  hotwire adds
  ``scale * vector`` to the first output of decoder layer N, the hidden-states half of vLLM's
  split residual stream, so the stream after layer N gets what ``blocks.N.hook_resid_post``
  with ``coef`` 1 adds.  hotwire fills its per-token table from vLLM's batch as it stands
  before the step adds its new requests (in vLLM 0.20.2 ``execute_model`` updates the batch
  after hotwire's wrapper ran), so prompts may go unsteered: each run records, per variant,
  the share of requests whose first token and whole output equal vanilla's and steer's
  (``agreement``).  Its plugin sets ``VLLM_USE_FLASHINFER_SAMPLER=0`` where it finds no CUDA
  toolkit (recorded with its engine); greedy sampling, as here, uses neither sampler.

Runs are interleaved (each round runs every variant once, in a rotated order) after one
warm-up round; the table reports the median generated tokens/s, the spread, and each median
as a ratio to (1).  Engine modes (compile, CUDA graphs, async scheduling), compile-cache
state, boot times, KV-cache size and the instrumentation's buffer memory and host time are
recorded with the numbers, and so is what was generated: a random-weight model's tokens are
arbitrary, and ids past the tokenizer's vocabulary (the 8B shape has 128,256 ids, SmolLM2's
tokenizer 49,152) cost the front end's detokenizer more than known ones
(measured: 3 to 6 times as much per token when one such id repeats), so
each run records the share of such ids.  ``--no-detokenize`` leaves detokenizing out for every variant.

``--py-spy BIN`` samples the instrumented engine's core process and its front-end process
with py-spy (every thread, idle ones too; Python frames only, since native unwinding slowed a
steered run fifteenfold) during extra runs, and writes the raw stacks next to ``--out``: one
run of each steering or capturing variant after the measured rounds, and one of ``plain``
before the first round and after the last (to compare an engine early and late in its life).
Every run also records which processes and threads used the host's CPU (``proc_stats.py``).
Three engines need ``--gpu-memory-utilization`` 0.3 at most.

``--quantization fp8`` quantizes every engine's weights as vLLM loads them; a GPTQ checkpoint
(``gptq_checkpoint.py``) is given as ``--model``.  ``--lora DIR`` runs every request of every
engine with one LoRA adapter (vanilla vLLM with the same LoRA settings).  Each ratio is then to
vanilla vLLM with the same quantization or adapter.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cpu_pinning  # bench/ is on sys.path when this file runs as a script
import gpu_power
import proc_stats

from inspect_tl_vllm.engine.adapters import read_adapter

VARIANTS = ["vanilla", "plain", "steer", "capture", "capture_all"]
STORED = {"capture_all_disk": "disk", "capture_all_s3": "s3"}
"""Variants that store ``capture_all``'s activations as the provider does, and where."""
S3_BUCKET = "tlvllm-bench"
HOTWIRE_PLUGIN = "hotwire"  # hotwire-vllm's entry point in vllm.general_plugins
# Model shapes: a config.json (bos/eos ids and tokenizer from SmolLM2) loaded with dummy weights.
# llama8b-shape's config must stay byte-identical: earlier results were measured on it.
SHAPES: dict[str, dict[str, Any]] = {
    "llama8b-shape": {  # Llama-3-8B
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 128256,
    },
    "llama1b-shape": {  # Llama-3.2-1B (without its llama3 rope scaling: prompts stay short)
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "vocab_size": 128256,
    },
    "gemma2b-shape": {  # Gemma-2-2B
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "vocab_size": 256000,
    },
}


def model_dir(name: str, scratch: Path) -> tuple[str, dict[str, Any]]:
    """Path and extra engine arguments; a shape is its config plus SmolLM2's tokenizer, so that
    no weights need downloading (vLLM's dummy weights, or ``--weights scaled``)."""
    from inspect_tl_vllm.aliases import resolve_model

    if name not in SHAPES:
        return resolve_model(name), {}
    source = Path(resolve_model("smollm2"))
    target = scratch / name
    target.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            (target / file.name).write_bytes(file.read_bytes())
    tokenizer = json.loads((source / "config.json").read_text())
    config = dict(SHAPES[name])
    for key in ("bos_token_id", "eos_token_id"):
        config[key] = tokenizer.get(key)
    (target / "config.json").write_text(json.dumps(config, indent=1))
    return str(target), {"load_format": "dummy"}


def chat_prompts(path: str, count: int) -> list[list[int]]:
    """Token ids of ``count`` chat prompts from the shipped question set, all distinct."""
    from transformers import AutoTokenizer

    root = Path(__file__).resolve().parent.parent
    questions = [json.loads(line)["input"] for line in (root / "evals/data/short_answers.jsonl").open()]
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = []
    for i in range(count):
        text = f"{questions[i % len(questions)]} (Question {i + 1}; answer in detail.)"
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        prompts.append(list(ids))
    return prompts


def engine_modes(llm: Any) -> dict[str, Any]:
    config = llm.llm_engine.vllm_config
    return {
        "compilation_mode": str(config.compilation_config.mode),
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
        "compile_cache_disabled": os.environ.get("VLLM_DISABLE_COMPILE_CACHE", "0") not in ("", "0"),
        "kv_cache_blocks": config.cache_config.num_gpu_blocks,
        "block_size": config.cache_config.block_size,
    }


def serve(
    kind: str,
    path: str,
    engine_args: dict[str, Any],
    prompts: list[list[int]],
    weights: str,
    conn: Any,
    peer: dict[str, Any],
) -> None:
    """One engine in its own process, running the variants the parent asks for.

    ``kind`` is ``vanilla`` (no plugin), ``instrumented`` (this project) or ``hotwire``
    (hotwire-vllm's plugin alone, from ``peer["hotwire_dir"]``, which only this process sees),
    with ``@V1`` or ``@V2`` for the model runner it must use (``--runners``)."""
    kind, _, runner = kind.partition("@")
    if runner:  # before vLLM is imported: the runner is chosen from the environment
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "V2" else "0"
    if kind == "vanilla":
        os.environ["VLLM_PLUGINS"] = ""  # before vLLM is imported: no plugin, ours included
    peer_info = prepare_hotwire(path, len(prompts), peer) if kind == "hotwire" else {}
    plugins = general_plugins()  # what vLLM would find; hotwire must be there only for its own engine
    if (HOTWIRE_PLUGIN in plugins) != (kind == "hotwire") and kind != "vanilla":
        raise RuntimeError(f"{kind} engine: vllm.general_plugins found here are {plugins}")
    if weights == "scaled":  # collective_rpc pickles the function; these are the bench's own engines
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    started = time.time()
    engine_args = dict(engine_args)
    lora = engine_args.pop("lora", None)
    if kind in ("vanilla", "hotwire"):
        from vllm import LLM

        if lora is not None:  # the same adapter and vLLM settings the instrumented engine gets
            engine_args.update(read_adapter(lora).engine_args())
            os.environ["TLVLLM_BENCH_LORA"] = lora
        llm = LLM(model=path, **engine_args)
        engine = None
    else:
        import inspect_tl_vllm

        engine = inspect_tl_vllm.boot(path, instrument={"max_vectors": len(prompts)}, lora=lora, **engine_args)
        llm = engine.llm
    info = {"boot_s": round(time.time() - started, 1), **engine_modes(llm)}
    info.update(general_plugins=plugins, vllm_plugins=os.environ.get("VLLM_PLUGINS"))
    if peer_info:  # read after boot: hotwire's plugin may set the sampler variable while it registers
        info["hotwire"] = {**peer_info, "VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER")}
    if weights == "scaled":
        from scaled_weights import rescale  # bench/ is on sys.path (this file's folder)

        info["rescaled"] = llm.collective_rpc(rescale)[0]
    if engine is not None:
        status = engine.status()
        info["buffer_bytes"] = status["buffer_bytes"]
        info["runner"] = status["runner"]
        info["sites"] = len(status["sites"])
    conn.send(info)
    width = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    layers = llm.llm_engine.vllm_config.model_config.hf_text_config.num_hidden_layers
    vectors = steering_vectors(width, len(prompts))
    vocab = len(llm.get_tokenizer())
    while True:
        message = conn.recv()
        if message is None:
            break
        variant, new_tokens, options = message
        try:
            with sampled_by_py_spy(options.get("py_spy"), options.get("profile_to")):
                result = run_variant(engine, llm, base_variant(variant), new_tokens, prompts, vectors, layers, options)
            result["variant"] = variant
            result.update(token_stats(result.pop("token_ids"), vocab))  # the stats travel, not the ids
            conn.send(result)
        except Exception as err:  # report and keep serving: one failing variant must not lose the others
            conn.send({"variant": variant, "error": f"{type(err).__name__}: {err}"[:2000]})


def steering_vectors(width: int, count: int) -> list[Any]:
    """One vector per request for the steering variants; hotwire's engine gets the same ones."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return [torch.randn(width, generator=generator) * 2 for _ in range(count)]


def general_plugins() -> list[str]:
    """Names of the vLLM general plugins this process can discover (installed distributions)."""
    from importlib.metadata import entry_points

    return sorted(ep.name for ep in entry_points(group="vllm.general_plugins"))


def prepare_hotwire(path: str, count: int, peer: dict[str, Any]) -> dict[str, Any]:
    """Make hotwire-vllm's plugin, and only it, load in this process and the engine it starts.

    hotwire loads its vectors when the model loads, from ``HOTWIRE_VECTORS`` (a folder of
    ``.pt`` files, one tensor each; a file's name is its vector id), so they are written
    before the engine boots: request i gets vector i of ``steering_vectors``, as in ``steer``.
    Each distinct (vector, layer, scale) keeps one of ``HOTWIRE_SLOTS`` slots for good, so there
    is one slot per request; repeated rounds reuse them."""
    import torch
    from transformers import AutoConfig

    folder = str(Path(peer["hotwire_dir"]).resolve())
    sys.path.insert(0, folder)  # for this process; PYTHONPATH for the engine core it spawns
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p)
    os.environ["VLLM_PLUGINS"] = HOTWIRE_PLUGIN  # hotwire alone: not this project's plugin
    text = AutoConfig.from_pretrained(path).get_text_config()
    vectors = Path(peer["scratch"]) / "hotwire-vectors"
    shutil.rmtree(vectors, ignore_errors=True)
    vectors.mkdir(parents=True)
    for i, vector in enumerate(steering_vectors(int(text.hidden_size), count)):
        torch.save(vector, vectors / f"{hotwire_id(i)}.pt")
    os.environ["HOTWIRE_VECTORS"] = str(vectors)
    os.environ["HOTWIRE_SLOTS"] = str(count)
    from importlib.metadata import version

    middle = int(text.num_hidden_layers) // 2
    return {
        "version": version("hotwire-vllm"),
        "vectors": "one per request, as steer",
        "layer": middle,
        "equals_hook": f"blocks.{middle}.hook_resid_post",
        "scale": 1.0,
        "slots": count,
    }


def hotwire_id(index: int) -> str:
    return f"v{index:04d}"


def hotwire_requests(count: int, layer: int, scale: float = 1.0) -> list[dict[str, str]]:
    """``SamplingParams.extra_args`` per request: its own vector at ``layer``, every position.

    hotwire adds ``scale * vector`` to the hidden-states half of decoder layer ``layer``'s
    output; vLLM's residual stream is that plus the residual half, so this is ``steer``'s
    ``blocks.{layer}.hook_resid_post`` with ``coef`` = ``scale``."""
    spec = {"layer": layer, "scale": scale}
    return [{"hotwire": json.dumps({"id": hotwire_id(i), **spec})} for i in range(count)]


@contextlib.contextmanager
def sampled_by_py_spy(binary: str | None, output: str | None) -> Iterator[None]:
    """Record the stacks of the engine core process (into ``output``) and of this front-end
    process (``output`` with ``.frontend`` added) with py-spy while the block runs (if asked)."""
    if not binary or not output:
        yield
        return
    import psutil

    children = psutil.Process().children(recursive=True)
    core = next((c for c in children if "EngineCore" in c.name() + " ".join(c.cmdline())), None)
    if core is None:
        print("[bench] py-spy: no EngineCore process found; not profiling", flush=True)
        yield
        return
    spies = []
    for pid, path in ((core.pid, output), (os.getpid(), f"{output}.frontend")):
        command = [binary, "record", "--pid", str(pid), "--threads", "--idle", "--rate", "100"]
        spies.append(subprocess.Popen([*command, "--format", "raw", "--output", path], stdout=subprocess.DEVNULL))
    time.sleep(1.0)  # let them attach
    try:
        yield
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for spy in spies:
            try:
                spy.wait(timeout=60)
            except subprocess.TimeoutExpired:
                spy.kill()
        print(f"[bench] py-spy exited {[spy.returncode for spy in spies]}; stacks in {output}*", flush=True)


def token_stats(token_ids: list[list[int]], vocab: int) -> dict[str, Any]:
    """What was generated: distinct ids, the share of ids the tokenizer does not know, and per
    request its first id and a checksum of all (``agreement`` compares variants with them)."""
    flat = [t for ids in token_ids for t in ids]
    unknown = sum(1 for t in flat if t >= vocab)
    digests = [
        (int(ids[0]) if len(ids) else -1, zlib.crc32(json.dumps([int(t) for t in ids]).encode())) for ids in token_ids
    ]
    return {
        "distinct_tokens": len(set(flat)),
        "unknown_token_share": round(unknown / max(len(flat), 1), 4),
        "digests": digests,
    }


def run_variant(
    engine: Any,
    llm: Any,
    variant: str,
    new_tokens: int,
    prompts: list[list[int]],
    vectors: list,
    layers: int,
    options: dict[str, Any],
) -> dict[str, Any]:
    """Time one pass over all prompts."""
    from vllm import SamplingParams

    params = dict(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=options["detokenize"])
    before = engine.status() if engine is not None else None
    specs = None
    if engine is not None:  # the caller's specs exist before the call, as a user's would
        sae = None
        if variant in SAE_VARIANTS:
            width = llm.llm_engine.vllm_config.model_config.get_hidden_size()
            sae = random_sae(options["scratch"], width, f"blocks.{layers // 2}.hook_resid_post")
        specs = variant_specs(variant, vectors, layers, sae)
    t0 = time.perf_counter()
    if engine is None:
        sampling: Any = SamplingParams(**params)
        if variant == "hotwire":
            requests = hotwire_requests(len(prompts), layers // 2)
            sampling = [SamplingParams(**params, extra_args=extra) for extra in requests]
        lora = os.environ.get("TLVLLM_BENCH_LORA")
        lora_request = read_adapter(lora).request() if lora else None
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False, lora_request=lora_request
        )
        token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    else:
        outputs = engine.generate(prompts, specs=specs, **params)
        token_ids = [o.token_ids for o in outputs]
        phases = {key: round(value, 3) for key, value in engine.last_timings.items()}
        if variant in STORED:
            generated_s = time.perf_counter() - t0
            stored = store_outputs(outputs, options["stores"][STORED[variant]])
            stored_s = time.perf_counter() - t0 - generated_s
            phases.update(until_generated_s=round(generated_s, 3), store_s=round(stored_s, 3))
    elapsed = time.perf_counter() - t0
    if variant in STORED:
        phases.update(stored)
        remove_stored(options["stores"][STORED[variant]])
    generated = sum(len(ids) for ids in token_ids)
    result = {"variant": variant, "seconds": elapsed, "generated": generated, "tok_s": generated / elapsed}
    result["token_ids"] = token_ids
    if engine is not None:
        result["phases_s"] = phases
        after = engine.status()
        result["worker"] = after
        result["worker_steps"] = after["steps"] - before["steps"]
        result["worker_step_kinds"] = {k: v - before["step_kinds"].get(k, 0) for k, v in after["step_kinds"].items()}
        result["worker_host_s"] = {k: round(v - before["host_seconds"][k], 3) for k, v in after["host_seconds"].items()}
        pinned = after["pinned_host"]  # pinned blocks made during this run, and the time it took
        result["pinned_host"] = {
            "blocks_made": pinned["blocks_made"] - before["pinned_host"]["blocks_made"],
            "alloc_s": round(pinned["alloc_seconds"] - before["pinned_host"]["alloc_seconds"], 4),
            "gb_held": round(pinned["bytes_held"] / 1e9, 2),
        }
    return result


def store_outputs(outputs: list[Any], location: str) -> dict[str, Any]:
    """Store each output's activations as the provider stores a sample, in shards, with four
    threads; wait for the last shard to be stored. Returns what was stored."""
    from concurrent.futures import ThreadPoolExecutor

    from inspect_tl_vllm.store.folders import folder_at
    from inspect_tl_vllm.store.sample_store import write_sample
    from inspect_tl_vllm.store.shards import close_writer, writer_for

    folder = folder_at(location)
    folder.check_writable()
    writer = writer_for(folder, 256)

    def store(index: int) -> int:
        output = outputs[index]
        write_sample(
            folder,
            eval_id="bench",
            sample_id=index,
            epoch=1,
            sample_uuid=str(index),
            activations=output.activations,
            tokens=output.receipt.get("captures", {}),
            positions=output.positions,
            shards=writer,
        )
        return sum(t.numel() * t.element_size() for t in output.activations.values())

    with ThreadPoolExecutor(4) as pool:
        written = sum(pool.map(store, range(len(outputs))))
    close_writer(folder)
    return {"stored_bytes": written, "stored_samples": len(outputs)}


def remove_stored(location: str) -> None:
    from inspect_tl_vllm.store.folders import RemoteFolder, folder_at

    folder = folder_at(location)
    if isinstance(folder, RemoteFolder):
        folder.fs.rm(folder.root, recursive=True)
    else:
        shutil.rmtree(location, ignore_errors=True)


@contextlib.contextmanager
def s3_server(needed: bool) -> Iterator[None]:
    """A moto S3 server on localhost in a process of its own (``storage_remote.Server``) with the
    bench's bucket, and the environment that points s3fs at it (set here, so that the engine
    processes spawned later inherit it)."""
    if not needed:
        yield
        return
    from storage_remote import Server  # bench/ is on sys.path when this file runs as a script

    server = Server.start()
    os.environ.update(server.env)
    try:
        import s3fs

        s3fs.S3FileSystem().mkdir(S3_BUCKET)
        yield
    finally:
        server.stop()


SAE_FEATURES = 1 << 16
SAE_VARIANTS = ("sae_steer", "sae_clamp", "sae_capture", "sae_capture_prompt", "sae_capture_mean")


def random_sae(scratch: str, width: int, hook: str) -> str:
    """A JumpReLU SAE with random weights in SAELens' format (written once per shape)."""
    import torch
    from safetensors.torch import save_file

    folder = Path(scratch) / f"sae-{width}x{SAE_FEATURES}-{hook}"
    if (folder / "sae_weights.safetensors").is_file():
        return str(folder)
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    encoder = torch.randn(width, SAE_FEATURES, generator=generator) / width**0.5
    weights = {
        "W_enc": encoder,
        "W_dec": (encoder / encoder.norm(dim=0)).T.contiguous(),
        "b_enc": torch.zeros(SAE_FEATURES),
        "b_dec": torch.zeros(width),
        "threshold": torch.full((SAE_FEATURES,), 0.05),
    }
    save_file({name: t.to(torch.bfloat16) for name, t in weights.items()}, str(folder / "sae_weights.safetensors"))
    config = {"architecture": "jumprelu", "d_in": width, "d_sae": SAE_FEATURES, "metadata": {"hook_name": hook}}
    (folder / "cfg.json").write_text(json.dumps(config))
    return str(folder)


def base_variant(variant: str) -> str:
    """``steer@V2`` -> ``steer``: the work a variant does, without the model runner it runs on."""
    return variant.partition("@")[0]


def on_runner_of(name: str, variant: str) -> str:
    """Variant ``name`` on ``variant``'s model runner: ``vanilla``, ``steer@V2`` -> ``vanilla@V2``."""
    _, at, runner = variant.partition("@")
    return name + at + runner


def engine_for(variant: str) -> str:
    """The engine that runs a variant: ``vanilla``, ``hotwire`` or ``instrumented``, with the
    variant's ``@V1``/``@V2`` runner."""
    base, at, runner = variant.partition("@")
    return (base if base in ("vanilla", "hotwire") else "instrumented") + at + runner


def variant_specs(variant: str, vectors: list[Any], layers: int, sae: str | None = None) -> list[dict[str, Any] | None]:
    middle = layers // 2
    if variant == "plain":
        return [None] * len(vectors)
    if variant in ("sae_steer", "sae_clamp"):
        op = "add" if variant == "sae_steer" else "clamp"
        hook = f"blocks.{middle}.hook_resid_post"
        features = max(1, min(64, len(vectors) // 2))  # two bank rows each (decoder, encoder): within max_vectors
        return [
            {"interventions": [{"hook": hook, "op": op, "sae": sae, "feature": k % features, "coef": 4.0}]}
            for k in range(len(vectors))
        ]
    if variant in ("sae_capture", "sae_capture_prompt"):
        positions = "prompt" if variant == "sae_capture_prompt" else "all"
        return [{"capture": {"sae": sae, "top_k": 32, "positions": positions}} for _ in vectors]
    if variant == "sae_capture_mean":
        return [{"capture": {"sae": sae, "top_k": 32, "reduce": "mean", "positions": "generated"}} for _ in vectors]
    if variant == "capture_tokens":
        return [{"capture": {"hooks": [f"blocks.{middle}.hook_resid_post"], "dtype": "bfloat16"}} for _ in vectors]
    if variant in ("steer", "steer_list", "steer_zero"):
        hook, coef = f"blocks.{middle}.hook_resid_post", 0.0 if variant == "steer_zero" else 1.0
        given = [v.tolist() for v in vectors] if variant == "steer_list" else vectors
        return [{"interventions": [{"hook": hook, "vector": v, "coef": coef}]} for v in given]
    if variant == "capture":
        return [{"capture": {"hooks": [f"blocks.{middle}.hook_resid_post"], "reduce": "mean"}} for _ in vectors]
    if variant != "capture_all" and variant not in STORED:
        raise ValueError(f"unknown variant {variant!r}")
    hooks = ["blocks.0.hook_resid_pre", *(f"blocks.{i}.hook_resid_post" for i in range(layers))]
    return [{"capture": {"hooks": hooks, "positions": "prompt", "dtype": "bfloat16"}} for _ in vectors]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help=f"alias, path, or a shape: {', '.join(SHAPES)}")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--scratch", default="/tmp/tlvllm-bench")
    parser.add_argument("--cpu", action="store_true", help="tiny smoke run on vLLM's CPU build")
    parser.add_argument("--no-detokenize", action="store_true", help="detokenize=False for every variant")
    parser.add_argument(
        "--weights",
        choices=["as-loaded", "scaled"],
        default="as-loaded",
        help="scaled: re-draw the weights at training-init scale after loading (scaled_weights.py)",
    )
    parser.add_argument(
        "--hotwire-dir",
        default=None,
        metavar="DIR",
        help="hotwire-vllm installed with pip install --no-deps --target DIR (variant hotwire)",
    )
    parser.add_argument("--py-spy", default=None, metavar="BIN", help="profile one extra run per instrumented variant")
    parser.add_argument(
        "--pin-cpus",
        choices=["on", "off"],
        default="off",
        help="on: each engine's front end and engine core on physical cores of their own, where the host "
        "has enough (cpu_pinning.py); off: the scheduler places them",
    )
    parser.add_argument(
        "--runners",
        default=None,
        help="V1,V2: every variant on both of vLLM's model runners, each in engines of its own, interleaved in "
        "the same rounds and each compared with vanilla vLLM on the same runner (default: the runner vLLM picks)",
    )
    parser.add_argument(
        "--quantization", default=None, help="vLLM's quantization for every engine (fp8: weights quantized at load)"
    )
    parser.add_argument(
        "--lora", default=None, metavar="DIR", help="a PEFT LoRA adapter every request of every engine runs with"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    variants = args.variants.split(",")
    if args.runners:
        runners = args.runners.split(",")
        if not set(runners) <= {"V1", "V2"}:
            parser.error(f"--runners takes V1 and V2, not {args.runners}")
        variants = [f"{variant}@{runner}" for runner in runners for variant in variants]
    kinds = list(dict.fromkeys(map(engine_for, variants)))
    if "hotwire" in kinds and not (args.hotwire_dir and (Path(args.hotwire_dir) / "hotwire").is_dir()):
        parser.error("variant hotwire needs --hotwire-dir DIR holding hotwire-vllm (pip install --target DIR)")
    if not args.cpu and len(kinds) * args.gpu_memory_utilization > 0.95:
        parser.error(f"{len(kinds)} engines x --gpu-memory-utilization {args.gpu_memory_utilization} exceed the GPU")
    with s3_server(any(STORED.get(base_variant(variant)) == "s3" for variant in variants)):
        return measure(args, variants, kinds)


def measure(args: argparse.Namespace, variants: list[str], kinds: list[str]) -> int:
    """Boot the engines, run the warm-up round and the measured rounds, write the summary."""

    path, extra = model_dir(args.model, Path(args.scratch))
    prompts = chat_prompts(path, args.prompts)
    engine_args = {"max_model_len": args.max_model_len, "dtype": "bfloat16", "enable_prefix_caching": False, **extra}
    if args.cpu:
        engine_args.update(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 30)
    else:
        engine_args["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.quantization:
        engine_args["quantization"] = args.quantization
    if args.lora:  # each engine serves the adapter (serve() turns this into vLLM's or tl-vllm's arguments)
        engine_args["lora"] = str(Path(args.lora).resolve())
    context = mp.get_context("spawn")
    engines: dict[str, Any] = {}
    summary: dict[str, Any] = {"model": args.model, "prompts": args.prompts, "new_tokens": args.new_tokens}
    summary["detokenize"] = not args.no_detokenize
    summary["weights"] = args.weights
    summary["engine_args"] = engine_args
    peer = {"hotwire_dir": args.hotwire_dir, "scratch": args.scratch}
    for kind in kinds:
        parent, child = context.Pipe()
        process = context.Process(target=serve, args=(kind, path, engine_args, prompts, args.weights, child, peer))
        process.start()
        child.close()  # so that a child dying during boot reads as EOF here, not as a hang
        try:
            info = parent.recv()
        except EOFError:
            print(
                f"[bench] {kind} engine failed to boot (exit code {process.join(30) or process.exitcode})", flush=True
            )
            summary["errors"] = {**summary.get("errors", {}), kind: "engine failed to boot; see the log above"}
            write_summary(summary, {}, args.out, final=True)
            stop(engines)
            return 1
        print(f"[bench] {kind} engine up: {json.dumps(info)}", flush=True)
        summary[f"{kind}_engine"] = info
        engines[kind] = (process, parent)

    def run(variant: str, new_tokens: int, profile_to: str | None = None) -> dict[str, Any]:
        _, conn = engines[engine_for(variant)]
        options = {"detokenize": not args.no_detokenize, "py_spy": args.py_spy, "profile_to": profile_to}
        options["stores"] = {"disk": str(Path(args.scratch) / "stored"), "s3": f"s3://{S3_BUCKET}/stored"}
        options["scratch"] = args.scratch
        conn.send((variant, new_tokens, options))
        power: dict[str, Any] = {}
        procs: dict[str, Any] = {}
        with gpu_power.sampled(power), proc_stats.sampled(procs):
            result = conn.recv()
        return {**result, **power, **procs}

    def profile_plain(when: str) -> None:
        if args.py_spy and "plain" in variants:
            folder = Path(args.out).parent if args.out else Path(".")
            result = run("plain", args.new_tokens, str(folder / f"py_spy_{args.model}_plain_{when}.txt"))
            summary.setdefault("profiled_plain_tok_s", {})[when] = round(result.get("tok_s", 0), 1)
            print(f"[bench] plain under py-spy, {when}: {result.get('tok_s', 0):.0f} tok/s", flush=True)

    if args.pin_cpus == "on":
        summary["cpu_pinning"] = cpu_pinning.pin_engines({kind: process.pid for kind, (process, _) in engines.items()})
        print(f"[bench] CPU pinning: {json.dumps(summary['cpu_pinning'])}", flush=True)
    errors = summary.setdefault("errors", {})
    for variant in list(variants):  # warm-up round, not recorded; a variant that fails here is dropped
        result = run(variant, min(16, args.new_tokens))
        if "error" in result:
            print(f"[bench] {variant} failed in warm-up: {result['error']}", flush=True)
            errors[variant] = result["error"]
            variants.remove(variant)
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    profile_plain("first")
    for round_index in range(args.runs):
        order = variants[round_index % len(variants) :] + variants[: round_index % len(variants)]
        for variant in order:
            result = run(variant, args.new_tokens)
            if "error" in result:
                errors[variant] = result["error"]
                print(f"[bench] round {round_index + 1} {variant} failed: {result['error']}", flush=True)
                continue
            results[variant].append(result)
            print(f"[bench] round {round_index + 1} {variant}: {result['tok_s']:.0f} tok/s", flush=True)
        write_summary(summary, results, args.out, final=round_index == args.runs - 1)  # partial results survive a kill
    profile_plain("last")
    if args.py_spy:
        folder = Path(args.out).parent if args.out else Path(".")
        for variant in [v for v in variants if v not in ("vanilla", "plain")]:
            result = run(variant, args.new_tokens, str(folder / f"py_spy_{args.model}_{variant}.txt"))
            print(f"[bench] {variant} under py-spy: {result.get('tok_s', 0):.0f} tok/s", flush=True)
    stop(engines)
    return 0


def stop(engines: dict[str, Any]) -> None:
    """Ask each engine process to exit; terminate one that does not within two minutes."""
    for process, conn in engines.values():
        conn.send(None)
        process.join(timeout=120)
        if process.is_alive():
            process.terminate()


def write_summary(
    summary: dict[str, Any], results: dict[str, list[dict[str, Any]]], out: str | None, final: bool
) -> None:
    summary["rounds_done"] = min((len(runs) for runs in results.values()), default=0)
    summary["table"] = table(results)
    summary["agreement"] = agreement(results)
    kept = ("seconds", "tok_s", "worker_steps", "worker_step_kinds", "worker_host_s", "phases_s", "pinned_host")
    kept += ("distinct_tokens", "unknown_token_share", "gpu", "procs")
    summary["runs"] = {v: [{k: r[k] for k in kept if k in r} for r in rs] for v, rs in results.items()}
    instrumented = [
        runs[-1] for variant, runs in results.items() if engine_for(variant).startswith("instrumented") and runs
    ]
    if instrumented:
        summary["instrumented_worker_status"] = instrumented[-1]["worker"]
    text = json.dumps(summary, indent=1)
    if final:
        print(text)
    if out:
        Path(out).write_text(text)


def agreement(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per variant, the share of requests whose first generated token and whole output equal
    vanilla's and steer's, in the last run of each: whether a variant did the work it claims
    (a steered request should differ from vanilla; hotwire should follow steer, up to rounding)."""
    shares: dict[str, dict[str, Any]] = {}
    for name in ("vanilla", "steer"):
        for variant, runs in results.items():
            reference = on_runner_of(name, variant)
            if variant == reference or not runs or not results.get(reference):
                continue
            base = results[reference][-1]["digests"]
            if len(runs[-1]["digests"]) != len(base):
                continue
            pairs = list(zip(runs[-1]["digests"], base, strict=True))
            shares.setdefault(variant, {})[f"vs_{name}"] = {
                "first_token": round(sum(a[0] == b[0] for a, b in pairs) / len(pairs), 4),
                "output": round(sum(a == b for a, b in pairs) / len(pairs), 4),
            }
    return shares


def table(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Median tokens/s per variant, spread (min-max), and the ratio to the median of vanilla on the
    same model runner."""
    rows = []
    for variant, runs in results.items():
        if not runs:
            continue
        vanilla = results.get(on_runner_of("vanilla", variant))
        base = statistics.median(r["tok_s"] for r in vanilla) if vanilla else None
        speeds = [r["tok_s"] for r in runs]
        median = statistics.median(speeds)
        rows.append(
            {
                "variant": variant,
                "median_tok_s": round(median, 1),
                "min_tok_s": round(min(speeds), 1),
                "max_tok_s": round(max(speeds), 1),
                "ratio_to_vanilla": round(median / base, 4) if base else None,
            }
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
