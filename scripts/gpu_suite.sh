#!/usr/bin/env bash
# Everything the GPU checks and measures, in phases that each fit one 10-minute call on an H200 machine.
#
#   bash scripts/gpu_suite.sh tests  [pytest -k expr]   the `gpu` tests of one GPU (kernels, model vs HF, graphs, engine)
#   bash scripts/gpu_suite.sh bench                      throughput (greedy / sampled, workload, batch 1), the decode
#                                                        step's kernels and GPU/host time, decode and prefill kernels
#   bash scripts/gpu_suite.sh tp                         two GPUs: the tensor-parallel tests and TP=1 vs TP=2 (0.5B)
#   bash scripts/gpu_suite.sh tp7b                       two GPUs: TP=1 vs TP=2 on a random Qwen2-7B checkpoint
#   bash scripts/gpu_suite.sh runtime                    the engine, server, fuzz, disk-cache and prefill-matrix `gpu`
#                                                        tests, three queues on one GPU
#   bash scripts/gpu_suite.sh serve                      the HTTP server under Poisson load beside LLM.generate
#   [MODEL=DIR] bash scripts/gpu_suite.sh serve_mp       the server through the launcher (1, 2, 4 API servers) and
#                                                        the in-process one beside LLM.generate
#   bash scripts/gpu_suite.sh core                       the engine's host CPU per 1000 tokens, offline and as the
#                                                        engine core runs it (profile_core.py, 3 rounds, cProfile)
#   bash scripts/gpu_suite.sh final                      two GPUs: tensor parallelism (tests, TP=1 vs TP=2), then two
#                                                        queues: sampler tests + benches | graph tests + serving
#   bash scripts/gpu_suite.sh both                       two GPUs, two queues at once: the runtime tests then the
#                                                        engine benches on one, the kernel benches and layer tests
#                                                        on the other
#   MODEL=DIR bash scripts/gpu_suite.sh startup          LLM() and the first token in fresh processes: 5 cold starts
#                                                        (each on new cache directories) and 3 warm ones
#   OLD=DIR bash scripts/gpu_suite.sh ab                 this tree against the tree in DIR, alternating, 3 rounds:
#                                                        the nano-vllm workload and batch 1 (scripts/ab_trees.py)
#   [MODEL=DIR] bash scripts/gpu_suite.sh invariant      the batch-invariant mode: its `gpu` tests (and the prefill
#                                                        kernel's parts), cuBLAS with and without a workspace,
#                                                        the identity table (MODEL: the real checkpoint; default
#                                                        random 0.5B)
#   bash scripts/gpu_suite.sh invariant_cost             the mode's cost beside the default: the nano-vllm workload
#                                                        and batch 1, greedy and sampled, 3 rounds; its products
#   [MODEL=DIR] bash scripts/gpu_suite.sh step           the decode step as numba phases (kernels_numba/step.py): its
#                                                        `gpu` tests, its step time at 1-8 sequences beside the
#                                                        engine's step with the step kernel off and on (profile_step.py)
#
# Logs and results go to $OUT (default ./gpu_out) and are packed into $OUT/<phase>.tar.gz.
set -uo pipefail
phase=${1:?phase: tests | bench | tp | tp7b | runtime | serve | serve_mp | core | final | both | startup | ab | invariant | invariant_cost | step}
shift
OUT=${OUT:-gpu_out}
mkdir -p "$OUT/$phase"
dir="$OUT/$phase"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)"
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
run() {   # run NAME SECONDS CMD...: one step, its log in $dir/NAME.log, its exit code in the summary
    local name=$1 secs=$2
    shift 2
    local t0=$SECONDS
    timeout "$secs" "$@" > "$dir/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$dir/summary.txt"
    tail -n 4 "$dir/$name.log" | sed 's/^/    /'
}
{ nvidia-smi -L; python3 -c "import torch, numba, numpy; print(torch.__version__, numba.__version__, numpy.__version__)"; } \
    > "$dir/env.txt" 2>&1
case "$phase" in
tests)
    # twelve processes at once (spread over the GPUs when there are two): a fresh machine spends most of this
    # phase compiling kernels on the CPU, so each large group runs as contiguous --shard slices (each slice
    # compiles its own versions, on its own core) and every process fits the call's 10 minutes
    k=${1:-}
    gpus=$(nvidia-smi -L | wc -l)
    # several processes build engines at once: each KV pool takes a tenth of what is free, not 0.9
    export PAGEDATTN_GPU_MEMORY_UTILIZATION=${PAGEDATTN_GPU_MEMORY_UTILIZATION:-0.1}
    group() {   # group NAME GPU SECONDS SHARD FILES...   (SHARD "I/N", or "-" for the whole group)
        local name=$1 gpu=$(( $2 % gpus )) secs=$3 shard=()
        [ "$4" != - ] && shard=(--shard "$4")
        shift 4
        run "$name" "$secs" env CUDA_VISIBLE_DEVICES=$gpu python3 -m pytest -q -m gpu -p no:cacheprovider \
            ${k:+-k "$k"} ${shard[@]+"${shard[@]}"} "$@"
    }
    decode="tests/test_paged_attention_cuda.py tests/test_kernel_fuzz.py tests/test_cache_ops_cuda.py"
    prefill="tests/test_prefill_fa2.py tests/test_paged_prefill_cuda.py tests/test_attention_backend.py
        tests/test_paged_attention_runtime.py"
    layers="tests/test_fused_kernels.py tests/test_sampler.py tests/test_model_gpu.py"
    for i in 1 2 3 4; do group decode$i $i 540 $i/4 $decode & done
    for i in 1 2; do group prefill$i $i 540 $i/2 $prefill & done
    for i in 1 2; do group layers$i $i 540 $i/2 $layers & done
    group engine 1 540 - tests/test_cuda_graph.py tests/test_engine.py tests/test_async_engine.py tests/test_serving_gpu.py \
        tests/test_batch_invariance_gpu.py &
    # the step-level paths (work lists per step, piecewise graphs, launch plans) and the start-up /
    # lifecycle tests, which start processes of their own
    steps="tests/test_prefill_plan.py tests/test_piecewise_graph.py tests/test_launcher.py
        tests/test_kernel_codegen.py tests/test_step_kernel.py"
    for i in 1 2; do group steps$i $i 540 $i/2 $steps & done
    group life 0 540 - tests/test_startup.py tests/test_lifecycle.py &
    wait
    ;;
bench)
    run throughput 300 python3 scripts/bench_throughput.py --out "$dir" --time-limit 40
    run profile 150 python3 scripts/profile_step.py --out "$dir" --sampled
    run kernels 150 python3 scripts/bench_kernels.py --out "$dir"
    run prefill 120 python3 scripts/bench_prefill.py --out "$dir"
    run sampling 300 python3 scripts/bench_sampling.py --out "$dir"
    ;;
tp)
    run tp_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_tensor_parallel.py
    run tp_bench 280 python3 scripts/bench_throughput.py --mode tp --config 0.5b --num-requests 128 --time-limit 40 --out "$dir"
    ;;
tp7b)
    run tp7b 580 python3 scripts/bench_throughput.py --mode tp --config 7b --num-requests 64 --time-limit 60 \
        --runs tp1_graphs,tp2_graphs --out "$dir"
    ;;
both)
    (
        export CUDA_VISIBLE_DEVICES=1
        run runtime 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda_graph.py tests/test_engine.py \
            tests/test_async_engine.py tests/test_serving_gpu.py tests/test_model_gpu.py
        run throughput 300 python3 scripts/bench_throughput.py --out "$dir" --time-limit 30
    ) &
    (
        export CUDA_VISIBLE_DEVICES=0
        run profile 120 python3 scripts/profile_step.py --out "$dir" --sampled
        run sampling 200 python3 scripts/bench_sampling.py --out "$dir" --rows 1,256
        run kernels 150 python3 scripts/bench_kernels.py --out "$dir" --no-flex
        run prefill 120 python3 scripts/bench_prefill.py --out "$dir"
        run layers 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fused_kernels.py
    ) &
    wait
    ;;
final)
    run tp_tests 140 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_tensor_parallel.py \
        -k "layer_by_layer and None or engine_tp2 or nccl"
    run tp_bench 110 python3 scripts/bench_throughput.py --mode tp --config 0.5b --num-requests 64 --time-limit 15 \
        --runs tp1_graphs,tp2_graphs --out "$dir"
    (
        export CUDA_VISIBLE_DEVICES=0
        run sampler_tests 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sampler.py
        run sampling 90 python3 scripts/bench_sampling.py --out "$dir" --rows 1,256 --no-one-cta
        run throughput 110 python3 scripts/bench_throughput.py --out "$dir" --time-limit 20
    ) &
    (
        export CUDA_VISIBLE_DEVICES=1
        run graph_tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda_graph.py \
            tests/test_fused_kernels.py
        run serve 180 python3 scripts/bench_serving.py --model random --rates 32,inf --num-requests 128 --out "$dir"
    ) &
    wait
    ;;
runtime)
    run engine 560 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_engine.py tests/test_async_engine.py \
        tests/test_serving_gpu.py tests/test_model_gpu.py tests/test_cuda_graph.py &
    run fuzz 560 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernel_fuzz.py tests/test_kernel_codegen.py &
    run prefill_matrix 560 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_prefill_fa2.py -k full_matrix &
    wait
    ;;
serve)
    run serve 560 python3 scripts/bench_serving.py --model "${MODEL:-random}" --out "$dir"
    ;;
serve_mp)
    # the server through the launcher (engine core in its own process; 1, 2, 4 API servers) and the in-process
    # one beside LLM.generate: 256 streams at once from 8 client processes, and one request at a time
    run serve_mp 570 python3 scripts/bench_serving.py --model "${MODEL:-random}" --out "$dir" --time-budget 480
    ;;
core)
    run profile_core 450 python3 scripts/profile_core.py --runs 3 --profile --out "$dir"
    ;;
invariant)
    run tests 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_batch_invariance_gpu.py
    run parts 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_prefill_fa2.py -k parts_fixed
    run no_split_k 60 python3 scripts/probe_no_split_k.py --out "$dir"
    run identity 300 python3 scripts/gpu_batch_invariant.py --parts identity ${MODEL:+--model "$MODEL"} --out "$dir"
    ;;
invariant_cost)
    run cost 300 python3 scripts/gpu_batch_invariant.py --parts cost --dtypes float16 --out "$dir"
    run gemm 240 python3 scripts/gpu_batch_invariant.py --parts gemm --out "$dir"
    ;;
step)
    run tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_step_kernel.py
    run step_kernel 200 python3 scripts/bench_step_kernel.py --phases ${MODEL:+--model "$MODEL"} --out "$dir"
    for sk in off on; do                 # the engine's step with the step kernel off and on (EngineConfig.step_kernel)
        run profile_$sk 90 python3 scripts/profile_step.py --batches 1,2,4,8 --step-kernel $sk --max-model-len 1024 \
            --prefill-seqs 1 --prefill-len 64 ${MODEL:+--model "$MODEL"} --out "$dir/profile_$sk"
    done
    ;;
startup)
    run startup 580 python3 scripts/startup_times.py --model "${MODEL:?MODEL=checkpoint dir}" --device cuda \
        --dtype float16 --fresh 5 --warm 3 --out "$dir"
    ;;
ab)
    run ab 580 python3 scripts/ab_trees.py --trees "${OLD:?OLD=the other tree},." --rounds 3 --out "$dir"
    ;;
*)
    echo "unknown phase $phase"; exit 2 ;;
esac
tar -czf "$OUT/$phase.tar.gz" -C "$OUT" "$phase"
cat "$dir/summary.txt"
