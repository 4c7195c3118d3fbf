"""Sections encoder, encoder_3p and profile of bench/gpu/run.py: every encoder variant timed per batch and set
against the best dense peer, and where the encoder's time goes per kernel category."""
from __future__ import annotations

from typing import Any, Callable

from bench.gpu import peers
from bench.gpu.harness import Run, graph_of, guarded, log, measure
from bench.gpu.models import bert_base_random, hf_model, load_packed_checkpoint, token_batch


def plain_division(build):
    """The same encoder with the quantizer kernels dividing by the scale plainly (IEEE division, as
    before the FMA division): an A/B of that change in one run. Graph capture records the kernels as
    launched, so the switch only needs to hold while the encoder runs."""
    from holoserve.backends.torch_cuda import kernels

    def wrapped():
        call = build()

        def run_plain(inp):
            kernels.FMA_DIVISION = False
            try:
                return call(inp)
            finally:
                kernels.FMA_DIVISION = True
        return run_plain
    return wrapped


def _probe_tuning(run: Run) -> dict[str, Any]:
    """The 2:4 INT8 epilogues (FP16 and INT32 output), the quantizer and its fusions this GPU runs
    (cpu-smoke: no epilogue, the torch-op quantizer, no fusion)."""
    tuning: dict[str, Any] = {"epilogue": None, "epilogue32": None, "quantizer": "torch",
                              "gelu_fused": False, "ln_fused": False}
    if run.smoke:
        return tuning
    import torch

    from holoserve.backends import torch_cuda as tc

    try:
        tuning["epilogue"] = tc.choose_epilogue("cuda")[0]
    except Exception as e:  # noqa: BLE001 - the 2:4 variants then fail one by one, with this reason
        log(f"no working 2:4 INT8 epilogue: {e}")
    try:
        tuning["epilogue32"] = tc.choose_epilogue("cuda", torch.float32)[0]
    except Exception as e:  # noqa: BLE001
        log(f"no working INT32-output epilogue for precision=fp32: {e}")
    tuning["quantizer"], qprobe = tc.choose_quantizer("cuda")
    tuning["gelu_fused"] = bool(qprobe.get("gelu_fused"))
    tuning["ln_fused"] = bool(qprobe.get("ln_fused"))
    log(f"quantizer: {qprobe}")
    return tuning


def _torchao_builder(config: dict, sparse_state: dict, quant: dict, dt, dev):
    """Builder of torchao's 2:4 INT8 (int8_dynamic_activation_int8_semi_sparse_weight) on the encoder Linears."""
    def torchao_semi_sparse():
        import torch
        from torchao.quantization import quantize_
        from torchao.sparsity import int8_dynamic_activation_int8_semi_sparse_weight

        m = hf_model(config, sparse_state, dt, dev)
        layers = set(quant["layers"])
        quantize_(m, int8_dynamic_activation_int8_semi_sparse_weight(),
                  filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear) and fqn in layers)
        return lambda inp: m(**inp).logits
    return torchao_semi_sparse


def _gpu_variants(run: Run, ours, sparse_state: dict, tuning: dict[str, Any], torchao) -> list[tuple]:
    """The variants only a GPU runs: dense INT8 and ours with CUDA graphs, A/Bs of our kernel options, torchao."""
    import torch

    quantizer = tuning["quantizer"]
    v: list[tuple[str, Callable, bool, bool]] = [
        ("dense INT8 + CUDA graphs (_int_mm)", ours("cslt", sparse_state, sparse=False), True, False),
        ("2:4 INT8 eager (ours)", ours("cslt", sparse_state), False, False),
        ("2:4 INT8 + CUDA graphs (ours)", ours("cslt", sparse_state), True, False)]
    # cuSPARSELt called directly (nvmath-python): the FFN's first GEMM writes the second's codes (GELU and
    # quantizer in its epilogue), the other GEMMs as `cslt`
    v += [(f"2:4 INT8{mode} (ours, cslt_fused epilogues)", ours("cslt_fused", sparse_state), graphs, False)
          for mode, graphs in ((" eager", False), (" + CUDA graphs", True))]
    v.append(("2:4 INT8 + CUDA graphs (ours, cuSPARSELt alg search)",
              ours("cslt", sparse_state, alg_search=True), True, False))
    v.append(("2:4 INT8 + CUDA graphs (ours, precision=fp32: INT32 GEMM out, FP32 elsewhere)",
              ours("cslt", sparse_state, fuse=False, dtype=torch.float32), True, False))
    if tuning["gelu_fused"] or tuning["ln_fused"]:  # evidence for what the LayerNorm / GELU fusions buy
        v.append(("2:4 INT8 + CUDA graphs (ours, no LayerNorm/GELU fusion)",
                  ours("cslt", sparse_state, fuse=False), True, False))
    if quantizer == "triton":  # the FMA division in the quantizer kernels, A/B
        v.append(("2:4 INT8 + CUDA graphs (ours, plain division in the quantizers)",
                  plain_division(ours("cslt", sparse_state)), True, False))
        # the FFN activation + quantize as one gather from a table of every FP16 value's code, A/B with
        # the erf kernel (eager too, so that the profile section times its kernel)
        v += [(f"2:4 INT8{mode} (ours, FFN activation by code table)", ours("cslt", sparse_state, tables=True),
               graphs, False) for mode, graphs in ((" eager", False), (" + CUDA graphs", True))]
    if quantizer != "torch":  # evidence for what the fused quantizer buys
        v.append(("2:4 INT8 + CUDA graphs (ours, unfused torch-op quantizer)",
                  ours("cslt", sparse_state, quantizer="torch"), True, False))
    if not run.args.no_torchao:
        v += [("torchao 2:4 INT8 eager", torchao, False, False),
              ("torchao 2:4 INT8 + CUDA graphs", torchao, True, True)]
    return v


def _encoder_variants(run: Run, config: dict, dense_state: dict, sparse_state: dict, quant: dict,
                      compile_peers: bool = True):
    """(name, builder, graphs, risky) tuples; each builder returns call(inputs) -> logits. compile_peers=False
    lists the torch.compile peers as skipped."""
    import torch

    from holoserve.backends import torch_cuda as tc

    dt = torch.float32 if run.smoke else torch.float16
    dev = run.device
    tuning = _probe_tuning(run)

    def hf_dense():
        m = hf_model(config, dense_state, dt, dev)
        return lambda inp: m(**inp).logits

    def hf_int8_dense():  # the 2:4 model's weights in dense INT8, with our activation scales
        return peers.int8_dense(hf_model(config, sparse_state, dt, dev), quant["layers"], quant["amax"])

    def ours(kernel, state, sparse=True, quantizer=tuning["quantizer"], alg_search=False, fuse=True, dtype=None,
             tables=False):
        def build(dt=dtype or dt):
            dense = kernel == "dense"  # the FP16 baseline keeps the state's own (dense) weights
            cq = tc.CheckpointQuant(weight_scales=None if dense else quant["scales"],
                                    act_amax=None if dense else quant["amax"],
                                    sparse_layers=quant["layers"] if sparse else ())
            epilogue = tuning["epilogue32"] if dt == torch.float32 and not run.smoke else tuning["epilogue"]
            enc = tc.build_encoder(config, state, cq, linear=tc.LinearOptions(
                kernel=kernel, dtype=dt, device=dev,
                tuning=tc.Tuning(epilogue=epilogue, quantizer=quantizer, alg_search=alg_search)),
                fusion=tc.Fusion(gelu_quant=tuning["gelu_fused"] and fuse, ln_quant=tuning["ln_fused"] and fuse))
            if tables:
                enc.use_code_tables()
            return lambda inp: enc(**inp)
        return build

    # risky=True: capturing third-party code whose forward may synchronize with the host; a failed
    # capture can leave the CUDA context unusable, so these run after everything else.
    prefix = "FP32" if run.smoke else "FP16"
    v: list[tuple[str, Callable, bool, bool]] = [
        (f"{prefix} eager (transformers)", hf_dense, False, False),
        (f"{prefix} + CUDA graphs (holoserve encoder)", ours("dense", dense_state), True, False),
    ]
    if run.smoke:
        v += [("INT8 reference (ours, CPU)", ours("reference", sparse_state), False, False),
              ("INT8 fake-quant (ours, CPU)", ours("fakequant", sparse_state), False, False)]
    else:
        v += _gpu_variants(run, ours, sparse_state, tuning, _torchao_builder(config, sparse_state, quant, dt, dev))
    v.append((f"{prefix} + CUDA graphs (transformers)", hf_dense, True, True))
    if not run.args.no_compile:  # Inductor's CUDA-graph trees: third-party captures, after our own
        mode = run.args.compile_mode
        skip = None if compile_peers else "cpu-smoke: compiled on the BERT-base stand-in only, to save time"
        v += [(f"{prefix} torch.compile {mode} (transformers, SDPA)",
               peers.compiled(lambda: hf_model(config, dense_state, dt, dev), mode, skip), False, True),
              (f"dense INT8 torch.compile {mode} (transformers, _int_mm, per-channel weights)",
               peers.compiled(hf_int8_dense, mode, skip), False, True)]
    return v


def _bench_variant(run: Run, build, graphs: bool, vocab: int) -> dict[str, Any]:
    import torch

    if graphs and run.smoke:
        return {"skipped": "cpu-smoke: CUDA graphs need a GPU"}
    if getattr(build, "skipped", None):
        return {"skipped": build.skipped}
    call = build()
    compile_mode = getattr(call, "compile_mode", None)
    sync = (lambda: None) if run.smoke else torch.cuda.synchronize
    out: dict[str, Any] = {"compile_mode": compile_mode} if compile_mode else {}
    pool_n = 4
    for b in run.args.batch_list:
        if run.over_budget():
            out[str(b)] = {"error": "skipped: time budget reached"}
            continue

        def one(b=b):
            gen = torch.Generator(device=run.device).manual_seed(1000 + b)
            pool = [token_batch(torch, b, run.args.seq, vocab, run.device, gen=gen) for _ in range(pool_n)]
            if graphs:
                static = {k: v.clone() for k, v in pool[0].items()}
                graph, _ = graph_of(lambda: call(static))

                def fn(i):
                    for k, v in pool[i % pool_n].items():
                        static[k].copy_(v)
                    graph.replay()
            else:
                def fn(i):
                    with torch.inference_mode():
                        call(pool[i % pool_n])
            first = peers.first_calls(fn, sync) if compile_mode else {}  # compiling, apart from the timed calls
            before = peers.dynamo_counts()
            r = measure(run, fn)
            r["seq_per_s"] = b / (r["median_ms"] * 1e-3)
            if compile_mode:
                r.update(first, recompiled_while_timed=peers.dynamo_counts()["graphs"] - before["graphs"])
                log(f"    batch {b}: compiled in {first['compile_s']:.1f} s, {first['graphs']} graphs, "
                    f"{first['graph_breaks']} graph breaks, {first['cudagraph_skips']} CUDA-graph skips")
            return r

        out[str(b)] = guarded(f"batch {b}", one)
    call = None  # free the model before the next section
    if compile_mode:
        peers.reset()
    if not run.smoke:
        torch.cuda.empty_cache()
    return out


def _bench_backend_end_to_end(run: Run, art, vocab: int) -> dict[str, Any]:
    """The torch-cuda backend as the server calls it: numpy in, numpy logits out (host timer)."""
    import numpy as np

    from holoserve.backends import load_backend

    backend = load_backend("torch-cuda", art, max_batch=max(run.args.batch_list))
    rng = np.random.default_rng(0)
    seq = min(run.args.seq, art.max_seq_length)  # the backend serves up to the checkpoint's max_seq_length
    out: dict[str, Any] = {"info": backend.info(), "seq": seq}
    lo = min(1000, vocab // 2)
    for b in run.args.batch_list:
        pool = [rng.integers(lo, vocab, size=(b, seq), dtype=np.int64) for _ in range(4)]

        def fn(i, pool=pool):
            ids = pool[i % len(pool)]
            backend.infer(ids, np.ones_like(ids), np.zeros_like(ids))

        r = guarded(f"backend batch {b}", lambda fn=fn: measure(run, fn, host_timer=True))
        if "median_ms" in r:
            r["seq_per_s"] = b / (r["median_ms"] * 1e-3)
        out[str(b)] = r
    out["info"] = backend.info()
    return out


def section_encoder(run: Run) -> dict[str, Any]:
    res: dict[str, Any] = {"seq": run.args.seq, "batches": run.args.batch_list, "models": {}}
    models = []
    # 1) the real checkpoint from --carry (MiniLM SST-2)
    if "checkpoint" in run.args.model_list:
        try:
            art, packed = load_packed_checkpoint(run)
            from holoserve.backends.torch_cuda import checkpoint_tensors

            config, state = checkpoint_tensors(art)
            quant = {"scales": art.all_weight_scales(), "amax": art.activation_amax(), "layers": art.sparse_layers}
            label = f"{art.base_model} · {art.task_name} checkpoint (carried, " + (
                "tiny random stand-in)" if run.smoke else "real weights)")
            models.append((label, config, state, state, quant, art))
        except Exception as e:  # noqa: BLE001
            log(f"packed checkpoint unavailable: {e}")
            res["models"]["checkpoint"] = {"error": str(e)}
    # 2) BERT-base shapes, random weights
    if "bert-base" in run.args.model_list:
        try:
            cfg, dense, sparse, quant_b = bert_base_random(run)
            models.append(("BERT-base shapes (RANDOM weights, 2:4-projected for the sparse variants)", cfg, dense,
                           sparse, quant_b, None))
        except Exception as e:  # noqa: BLE001
            log(f"BERT-base model failed: {e}")
            res["models"]["bert-base"] = {"error": str(e)}
    plan = []
    for label, config, dense_state, sparse_state, quant, art in models:
        entry: dict[str, Any] = {"config": {k: config.get(k) for k in ("hidden_size", "num_hidden_layers",
                                                                       "intermediate_size", "num_attention_heads")},
                                 "variants": {}}
        res["models"][label] = entry
        # cpu-smoke compiles (Inductor, C++) for one model only: the second would add as much again
        variants = _encoder_variants(run, config, dense_state, sparse_state, quant,
                                     compile_peers=not run.smoke or art is None)
        plan.append((label, entry, int(config["vocab_size"]), art, variants))
    run.encoder_plan = plan
    _encoder_pass(run, plan, risky_pass=False)
    return res


# Kernel (GPU) or operator (CPU smoke) names to categories; the first category with a matching
# substring wins. The run also keeps the top kernels by name, so a misfiled one can be seen.
PROFILE_CATEGORIES = (
    ("2:4 GEMM (cuSPARSELt)", ("sparse", "cusparselt", "cslt")),
    ("attention", ("flash", "fmha", "attention", "softmax", "sdpa", "bmm", "baddbmm")),
    ("dense GEMM", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "addmm", "aten::mm", "matmul", "linear", "int_mm")),
    # our Triton kernels are named for what they fuse (_gelu_quant, _add_ln_quant, _quant); _table_quant is
    # the FFN activation + quantize by code table (Encoder.use_code_tables), GELU's place in the forward
    ("GELU (+ quantize, fused)", ("gelu", "_table_quant")),
    ("LayerNorm (+ residual add, quantize, fused)", ("layer_norm", "layernorm", "add_ln")),
    ("activation quantizer", ("_quant", "triton", "quantize", "round", "clamp")),
)


def _profile_categories(events: list[tuple[str, float, int]], iters: int) -> dict[str, Any]:
    """(name, total ms, calls) per kernel -> ms per forward in each category, and the top kernels."""
    cats: dict[str, float] = {}
    for name, ms, _ in events:
        low = name.lower()
        cat = next((c for c, keys in PROFILE_CATEGORIES if any(k in low for k in keys)), "element-wise and other")
        cats[cat] = cats.get(cat, 0.0) + ms / iters
    total = sum(cats.values())
    top = sorted(events, key=lambda e: -e[1])[:15]
    return {"ms_per_forward": round(total, 4),
            "categories": {c: {"ms": round(v, 4), "share": round(v / total, 4) if total else None}
                           for c, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"name": n[:160], "ms_per_forward": round(ms / iters, 4), "calls_per_forward": c / iters}
                            for n, ms, c in top]}


def section_profile(run: Run) -> dict[str, Any]:
    """Where a whole encoder's time goes: torch.profiler over eager forwards of the BERT-base-shaped model
    (random weights) at the largest batch, per kernel category, FP16 (transformers) and ours (2:4 INT8).
    Kernel times are the same eager or in a graph; eager only adds the launch gaps between them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cfg, dense, sparse, quant = bert_base_random(run)
    variants = dict((name, build) for name, build, graphs, _ in _encoder_variants(run, cfg, dense, sparse, quant)
                    if not graphs)
    b, iters = max(run.args.batch_list), 5
    inp = token_batch(torch, b, run.args.seq, int(cfg["vocab_size"]), run.device, seed=7)
    acts = [ProfilerActivity.CPU] if run.smoke else [ProfilerActivity.CUDA]
    res: dict[str, Any] = {"batch": b, "seq": run.args.seq, "iters": iters,
                           "model": "BERT-base shapes (random weights)",
                           "timer": "operator self time on the CPU" if run.smoke else "CUDA kernel time (CUPTI)",
                           "variants": {}}
    for name in (n for n in variants if "eager" in n or "ours, CPU" in n):
        def one(name=name):
            call = variants[name]()
            with torch.inference_mode():
                for _ in range(2):
                    call(inp)
                if not run.smoke:
                    torch.cuda.synchronize()
                with profile(activities=acts) as prof:
                    for _ in range(iters):
                        call(inp)
                    if not run.smoke:
                        torch.cuda.synchronize()
            events = []
            for e in prof.key_averages():
                on_gpu = str(getattr(e, "device_type", "")).endswith("CUDA")
                if run.smoke:
                    us = getattr(e, "self_cpu_time_total", 0.0)
                elif on_gpu:
                    us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
                else:
                    continue
                if us > 0:
                    events.append((e.key, us / 1000, e.count))
            return _profile_categories(events, iters)

        res["variants"][name] = guarded(f"profile {name}", one)
        log(f"profile {name}: " + ", ".join(f"{c} {v['ms']:.3g} ms" for c, v in
                                            res["variants"][name].get("categories", {}).items()))
    return res


def section_encoder_3p(run: Run) -> dict[str, Any]:
    """The third-party CUDA-graph captures, last of all (a failed capture can spoil the context)."""
    plan = getattr(run, "encoder_plan", None)
    if not plan:
        return {"skipped": "no encoder models were built"}
    _encoder_pass(run, plan, risky_pass=True)
    for _, entry, _, _, _ in plan:
        encoder_ratios(entry, run.args.batch_list, run.args.seq)
    return {"variants_added_to": [label for label, *_ in plan]}


def _encoder_pass(run: Run, plan, *, risky_pass: bool) -> None:
    for risky_pass in (risky_pass,):
        for label, entry, vocab, art, variants in plan:
            log(f"encoder: {label}" + (" (third-party graph captures)" if risky_pass else ""))
            for name, build, graphs, risky in variants:
                if risky != risky_pass:
                    continue
                if run.over_budget():
                    entry["variants"][name] = {"error": "skipped: time budget reached"}
                    continue
                r = guarded(name,
                            lambda build=build, graphs=graphs, vocab=vocab: _bench_variant(run, build, graphs, vocab))
                entry["variants"][name] = r
                log(f"  {name}: " + ", ".join(
                    f"b{b} {r[b]['median_ms']:.3f} ms" for b in map(str, run.args.batch_list)
                    if isinstance(r.get(b), dict) and "median_ms" in r[b]))
                run.save()
            if not risky_pass and art is not None and not run.smoke:
                name = "torch-cuda backend end to end (host arrays, perf_counter" + (
                    f", seq {art.max_seq_length} = the checkpoint's max)" if art.max_seq_length < run.args.seq else ")")
                entry["variants"][name] = guarded(
                    "backend", lambda art=art, vocab=vocab: _bench_backend_end_to_end(run, art, vocab))
        for _, entry, _, _, _ in plan:
            encoder_ratios(entry, run.args.batch_list, run.args.seq)


def _cell_ms(r: Any, b: str) -> float | None:
    c = r.get(b) if isinstance(r, dict) else None
    return c["median_ms"] if isinstance(c, dict) and "median_ms" in c else None


def encoder_ratios(entry: dict[str, Any], batches, seq: int) -> None:
    """Per cell: speedup_vs_eager (over FP eager, transformers) and vs_best_dense (the fastest dense peer at
    that batch, over this variant: above 1 is faster); entry["best_dense"] names that peer per batch.
    Only cells at the section's seq are compared (the backend end to end may run at a shorter one)."""
    variants = entry["variants"]
    base_name = next((n for n in variants if "eager (transformers)" in n), None)
    same_seq = {n: r for n, r in variants.items() if isinstance(r, dict) and r.get("seq", seq) == seq}
    entry["best_dense"] = {}
    for b in map(str, batches):
        dense = [(ms, n) for n, r in same_seq.items() if peers.engine_kind(n) == "dense" and (ms := _cell_ms(r, b))]
        best = min(dense) if dense else None
        if best:
            entry["best_dense"][b] = {"engine": best[1], "median_ms": best[0]}
        base = _cell_ms(variants.get(base_name), b) if base_name else None
        for name, r in variants.items():
            ms = _cell_ms(r, b)
            if ms is None:
                continue
            if base:
                r[b]["speedup_vs_eager"] = base / ms
            if best and name in same_seq:
                r[b]["vs_best_dense"] = best[0] / ms
