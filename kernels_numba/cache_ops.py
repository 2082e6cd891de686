"""Cache operations on the paged KV pool: write new K/V at their slots, copy whole blocks.

Pool layout, per layer (see pagedattn/kv_cache.py):

    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]

Both operations move bits and compute nothing, so the kernels work on *integer views* of
the tensors: a row of head_dim fp16/bf16/fp32 values is copied as int64/int32/int16 words
(the widest that divides the row's bytes). That makes them exact for every dtype, bf16
included (numba has no bf16 type), and bitwise equal to the torch versions
`pagedattn.kv_cache.write_kv / copy_blocks`.

reshape_and_cache: grid = num_tokens CTAs; CTA t copies token t's [num_kv_heads, head_dim]
    key and value rows to slot_mapping[t] (-1 = padding: nothing is written).
copy_blocks: grid = (num_pairs, 2 * num_layers); CTA (p, c) copies block src -> dst of
    cache c, where caches = (k_0, ..., k_{L-1}, v_0, ..., v_{L-1}). All layers go in ONE
    launch: the caches are passed to the kernel as a *tuple* of arrays, which numba
    specialises on its length (one compilation per model) and indexes with blockIdx.y
    (a switch over the tuple in the generated code). No pointer arithmetic, and the same
    kernel runs unchanged in the CUDA simulator.

Two levels of API:
* `reshape_and_cache(...)`, `copy_blocks(...)`: torch tensors in, validated on the host
  (`KernelLaunchError` naming the field), launched on torch's current stream. Under
  NUMBA_ENABLE_CUDASIM=1 they take CPU tensors and run in the simulator.
* `launch_reshape_and_cache(...)`, `launch_copy_blocks(...)`: numba device arrays (or numpy
  arrays in the simulator) of integer words, no validation, an optional numba stream.
"""

from numba import cuda

from kernels_numba.bridge import as_array, cached_view, capturing, check_tensor, enable_disk_cache, torch_stream
from kernels_numba.errors import KernelLaunchError
from kernels_numba.launcher import launch as launch_kernel

THREADS = 128  # threads per CTA for both kernels: 4 warps striding over the words to copy

_WORD_DTYPES = ("int64", "int32", "int16")  # widest first (torch dtype names: this module imports torch only
_CACHE_DTYPES = ("float16", "bfloat16", "float32")  # where a launch needs it, so a compile worker goes without)


# ----------------------------------------------------------------------------------------
# kernels (integer words; exact for any element type)


@cuda.jit
def _reshape_and_cache_kernel(key, value, k_cache, v_cache, slot_mapping, block_size):
    # key, value: [T, Hkv, W] words; k_cache, v_cache: [num_blocks, Hkv, block_size, W] words
    t = cuda.blockIdx.x
    slot = slot_mapping[t]
    if slot < 0:  # padding token
        return
    block = slot // block_size
    offset = slot % block_size
    num_kv_heads = key.shape[1]
    words = key.shape[2]
    for i in range(cuda.threadIdx.x, num_kv_heads * words, cuda.blockDim.x):
        h = i // words
        w = i % words
        k_cache[block, h, offset, w] = key[t, h, w]
        v_cache[block, h, offset, w] = value[t, h, w]


@cuda.jit
def _copy_blocks_kernel(caches, block_mapping):
    # caches: tuple of 2 * num_layers arrays [num_blocks, words_per_block]
    # block_mapping: [num_pairs, 2] int64 rows (src, dst)
    pair = cuda.blockIdx.x
    cache = caches[cuda.blockIdx.y]
    src = block_mapping[pair, 0]
    dst = block_mapping[pair, 1]
    for w in range(cuda.threadIdx.x, cache.shape[1], cuda.blockDim.x):
        cache[dst, w] = cache[src, w]


enable_disk_cache(_reshape_and_cache_kernel, ("kernels_numba.cache_ops", "reshape_and_cache"),
                  recipe=(__name__, "_reshape_and_cache_kernel", None, None, None))
enable_disk_cache(_copy_blocks_kernel, ("kernels_numba.cache_ops", "copy_blocks"),
                  recipe=(__name__, "_copy_blocks_kernel", None, None, None))


# ----------------------------------------------------------------------------------------
# low-level launchers: arrays of words in, no checks


def launch_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, stream=0):
    """Launch the write kernel on arrays of integer words.

    key, value: [num_tokens, num_kv_heads, W]; k_cache, v_cache: [num_blocks, num_kv_heads,
    block_size, W] of the same integer dtype (W words per head_dim row); slot_mapping:
    [num_tokens] int64. numba device arrays, or numpy arrays in the simulator.
    stream: a numba stream (0 = default stream).
    """
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    launch_kernel(_reshape_and_cache_kernel, num_tokens, THREADS,
                  (key, value, k_cache, v_cache, slot_mapping, k_cache.shape[2]), stream)


def launch_copy_blocks(caches, block_mapping, stream=0):
    """Launch the block copy kernel.

    caches: tuple of arrays [num_blocks, words_per_block] of one integer dtype (all K caches
    then all V caches, or any order: every cache gets every pair); block_mapping: [num_pairs, 2]
    int64 (src, dst). numba device arrays, or numpy arrays in the simulator.
    """
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0 or len(caches) == 0:
        return
    launch_kernel(_copy_blocks_kernel, (num_pairs, len(caches)), THREADS, (tuple(caches), block_mapping), stream)


# ----------------------------------------------------------------------------------------
# torch entry points


def _word_view(t):
    """t viewed as the widest integer dtype whose size divides its last dim's bytes."""
    import torch

    row_bytes = t.shape[-1] * t.element_size()
    for name in _WORD_DTYPES:
        dt = getattr(torch, name)
        if row_bytes % dt.itemsize == 0:
            return t.view(dt)
    raise KernelLaunchError(f"rows of {t.shape[-1]} x {t.element_size()} bytes cannot be copied as words")


def _check_cache(name, cache):
    check_tensor(name, cache)
    if cache.dim() != 4:
        raise KernelLaunchError(
            f"{name} must be [num_blocks, num_kv_heads, block_size, head_dim], got shape {tuple(cache.shape)}"
        )
    if str(cache.dtype).removeprefix("torch.") not in _CACHE_DTYPES:
        raise KernelLaunchError(f"{name}.dtype must be float16, bfloat16 or float32, got {cache.dtype}")
    if not cache.is_contiguous():
        raise KernelLaunchError(f"{name} must be contiguous")


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, validate=True):
    """Write new K/V vectors into the pool at their slots (in place); matches `write_kv` bitwise.

    key, value: [num_tokens, num_kv_heads, head_dim], any float dtype (cast to the cache dtype
        on the host by torch when it differs, exactly as write_kv casts)
    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim], float16/bfloat16/float32
    slot_mapping: [num_tokens] int32/int64, slot = block_id * block_size + offset, -1 = skip
    validate: verify every slot is < num_blocks * block_size (one host sync; skipped
        automatically while a CUDA graph is being captured)
    Tensors on CUDA (CPU under the simulator); runs on torch's current stream.
    """
    import torch

    for name, t in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        check_tensor(name, t)
    _check_cache("k_cache", k_cache)
    _check_cache("v_cache", v_cache)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise KernelLaunchError(
            f"v_cache must match k_cache: {tuple(v_cache.shape)} {v_cache.dtype} vs "
            f"{tuple(k_cache.shape)} {k_cache.dtype}"
        )
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    if key.dim() != 3 or key.shape[1:] != (num_kv_heads, head_dim):
        raise KernelLaunchError(
            f"key must be [num_tokens, {num_kv_heads}, {head_dim}] to match the cache, got {tuple(key.shape)}"
        )
    if value.shape != key.shape:
        raise KernelLaunchError(f"value must have key's shape {tuple(key.shape)}, got {tuple(value.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise KernelLaunchError(
            f"slot_mapping must be [num_tokens={key.shape[0]}], got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise KernelLaunchError(f"slot_mapping.dtype must be int32 or int64, got {slot_mapping.dtype}")
    if key.shape[0] == 0:
        return
    if validate and not capturing():
        hi = int(slot_mapping.max())
        if hi >= num_blocks * block_size or int(slot_mapping.min()) < -1:
            raise KernelLaunchError(
                f"slot_mapping has slots outside [-1, {num_blocks * block_size}) "
                f"(num_blocks={num_blocks} x block_size={block_size})"
            )
    # the cast write_kv does, then a pure bit copy (the cache's word view must match key's)
    key = key.to(k_cache.dtype).contiguous()
    value = value.to(v_cache.dtype).contiguous()
    slot_mapping = slot_mapping.to(torch.int64).contiguous()
    kw, vw = _word_view(key), _word_view(value)
    kcw, vcw = k_cache.view(kw.dtype), v_cache.view(vw.dtype)
    # the pool's views are cached (the same tensors every step); the step's own tensors are not
    launch_reshape_and_cache(
        as_array(kw), as_array(vw), cached_view(kcw), cached_view(vcw), as_array(slot_mapping), torch_stream()
    )


def copy_blocks(k_caches, v_caches, block_mapping, validate=True):
    """Copy whole blocks src -> dst in every layer, K and V, in one launch; matches the torch
    `copy_blocks` bitwise.

    k_caches, v_caches: sequences (one per layer) of [num_blocks, num_kv_heads, block_size,
        head_dim] tensors, all of one shape and dtype (float16/bfloat16/float32), contiguous
    block_mapping: [num_pairs, 2] int rows (src_block, dst_block): a list, numpy array or tensor.
        The destinations must be distinct and must not be sources of other pairs (copy-on-write
        never produces such a mapping; torch's gather-then-scatter would define it, one launch
        of independent CTAs would not).
    validate: verify block ids and the rules above on the host (one host sync for a device
        tensor; skipped while a CUDA graph is being captured)
    """
    import torch

    k_caches, v_caches = list(k_caches), list(v_caches)
    if len(k_caches) == 0 or len(k_caches) != len(v_caches):
        raise KernelLaunchError(
            f"k_caches and v_caches must be non-empty lists of equal length, got {len(k_caches)} and {len(v_caches)}"
        )
    caches = k_caches + v_caches
    for i, c in enumerate(caches):
        name = f"k_caches[{i}]" if i < len(k_caches) else f"v_caches[{i - len(k_caches)}]"
        _check_cache(name, c)
        if c.shape != caches[0].shape or c.dtype != caches[0].dtype or c.device != caches[0].device:
            raise KernelLaunchError(
                f"{name} must match k_caches[0]: {tuple(c.shape)} {c.dtype} {c.device} vs "
                f"{tuple(caches[0].shape)} {caches[0].dtype} {caches[0].device}"
            )
    num_blocks = caches[0].shape[0]
    device = caches[0].device
    mapping = torch.as_tensor(block_mapping, dtype=torch.int64)
    if mapping.numel() == 0:
        return
    if mapping.dim() != 2 or mapping.shape[1] != 2:
        raise KernelLaunchError(f"block_mapping must be [num_pairs, 2] (src, dst), got {tuple(mapping.shape)}")
    if validate and not capturing():
        host = mapping.cpu()
        if int(host.min()) < 0 or int(host.max()) >= num_blocks:
            raise KernelLaunchError(f"block_mapping has block ids outside [0, {num_blocks})")
        dst = host[:, 1].tolist()
        if len(set(dst)) != len(dst):
            raise KernelLaunchError("block_mapping has a destination block more than once")
        if set(dst) & set(host[:, 0].tolist()):
            raise KernelLaunchError("block_mapping has a destination block that is also a source")
    mapping = mapping.to(device).contiguous()
    # each cache as [num_blocks, words_per_block]: a block of one layer is contiguous
    words = tuple(cached_view(_word_view(c.view(num_blocks, -1))) for c in caches)
    launch_copy_blocks(words, as_array(mapping), torch_stream())
