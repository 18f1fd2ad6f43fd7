"""Models layer: ``LayerModel`` over vLLM's decoder modules (``SUPPORTED_MODEL_TYPES``).

vLLM fuses q/k/v into one projection; the adapter splits it, and rotates
with each layer's vLLM rotary module (its fused kernel, ``FusedRotary``), so
the walk sees exactly the same interface as with Hugging Face modules. The
families' differences (norm placement, multipliers, soft-capping, windows)
are read the same way as in ``hf.py``. Families vLLM runs through its
Transformers backend (OLMo 2 in vLLM 0.32) keep Hugging Face's decoder with
vLLM's fused linear layers and attention in it, and one rotary module for
the model: the adapter reads them the same way and rotates with Hugging
Face's tables (``hf.table_rotary``). Runs inside a vLLM worker process.

In a connector job the walk's KV goes into the request's blocks of vLLM's
paged cache, layer by layer, through the attention backend's own
``do_kv_cache_update``; the active tokens then attend there with the
backend's own kernel, as vLLM's forward does (``PagedAttention``), or with
SDPA over the walk's dense copy where that is faster on this machine
(``VLLMDecoder.attends_with_kernel``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from ..fusion.attention import DenseAttention
from ..fusion.layers import Attention, TableRotary, TensorParallel, agreed
from .hf import check_supported, heads_first, layer_windows, post_norm_finish, qk_norm_kind, table_rotary

logger = logging.getLogger(__name__)

# Attention backends whose kernel the blend pass drives; on any other the walk
# writes the paged cache the same way and attends with SDPA. CPU_ATTN is tested
# here; FlashAttention and vLLM's Triton kernel take the same metadata and
# cache layout, and until a GPU run shows them (docs/offline-gpu.md) the
# probe's agreement check (``KERNEL_AGREEMENT``) stands between them and a
# wrong answer.
KERNEL_BACKENDS = ("CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN")
# The kernel is used only where its output on the probe's random queries and
# KV agrees with SDPA's to this share of SDPA's largest output: a kernel that
# reads the cache differently than the walk writes it is caught once, at
# start, and the pass attends with SDPA instead.
KERNEL_AGREEMENT = {torch.float32: 1e-3, torch.bfloat16: 3e-2, torch.float16: 1e-2}
# Which of the kernel and SDPA attends faster (``VLLMDecoder.attends_with_kernel``)
# depends on the CPU: on a Zen 4 with AVX-512 the kernel (249 against 359 ms
# for the benchmark's blend pass at 0.15), on a Zen 3 with AVX2 SDPA (27
# against 41 ms a layer).
# auto keeps the kernel unless SDPA is faster by more than this: near a tie the
# choice must not flip between processes on one machine.
KERNEL_MARGIN = 1.2


@dataclass(frozen=True)
class PagedCache:
    """One request's blocks in vLLM's paged KV cache: where a connector job's
    walk writes every layer and attends it."""

    kv_caches: list[torch.Tensor]  # per layer, as vLLM registered them
    block_ids: list[int]  # the request's blocks, in order
    block_size: int

    def slots(self, end: int, device: torch.device) -> torch.Tensor:
        """The cache slots of positions ``0..end``."""
        positions = torch.arange(end, device=device)
        blocks = torch.tensor(self.block_ids, device=device, dtype=torch.long)
        return blocks[positions // self.block_size] * self.block_size + positions % self.block_size


class VLLMRanks:
    """``Ranks`` of vLLM's tensor-parallel group in this worker (its own
    communicator, as the model's layers use it)."""

    def __init__(self) -> None:
        from vllm.distributed.parallel_state import get_tp_group

        self.group = get_tp_group()
        self.size, self.rank = self.group.world_size, self.group.rank_in_group
        self.device = self.group.device

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(x)


class VLLMTensorParallel(VLLMRanks):
    """``TensorParallel`` over vLLM's tensor-parallel group.

    vLLM gives rank r the KV heads ``r * n / size`` up to the next rank's when
    the model has n >= size KV heads; with fewer, each head is copied to
    ``size / n`` neighbouring ranks, so rank r holds head ``r // (size / n)``.
    """

    def __init__(self, local_kv_heads: int, total_kv_heads: int) -> None:
        super().__init__()
        self.total_kv_heads = total_kv_heads
        self.replicas = max(1, self.size // total_kv_heads)  # ranks holding each KV head
        first = self.rank // self.replicas * local_kv_heads
        self.kv_heads = slice(first, first + local_kv_heads)

    def gather_kv_heads(self, x: torch.Tensor) -> torch.Tensor:
        every = self.group.all_gather(x.contiguous(), dim=2)
        return every[:, :, :: self.replicas] if self.replicas > 1 else every


class VLLMDecoder:
    """Adapts a vLLM ``*ForCausalLM`` of a supported family to ``LayerModel``."""

    def __init__(self, model, vllm_config=None, walk_attention: str = "auto") -> None:
        config = model.config
        self.vllm_config = vllm_config  # for the attention metadata builder; None: attention with SDPA only
        self.walk_attention = walk_attention  # "auto", "kernel" or "sdpa" (``vllm_contract.WALK_ATTENTION``)
        check_supported(config)
        self.config = config
        self.causal_lm = model  # its compute_logits: a live check's walk decodes (``engines.vllm_check``)
        self.inner = model.model
        self.layers = list(self.inner.layers)
        attn = self.layers[0].self_attn
        kernel = attn.attn  # vLLM's attention layer; under tensor parallelism, this rank's heads only
        tp = VLLMTensorParallel(kernel.num_kv_heads, config.num_key_value_heads or config.num_attention_heads)
        self.tp: TensorParallel | None = tp if tp.size > 1 else None
        # vLLM's own models rotate in each layer; its Transformers backend keeps the model's one rotary module
        self.fused_rotary = hasattr(attn, "rotary_emb")
        if self.fused_rotary and not all(block.self_attn.rotary_emb.is_neox_style for block in self.layers):
            raise NotImplementedError(
                "blending needs neox-style (rotate-half) RoPE, the layout of the supported families"
            )
        self.num_layers = len(self.layers)
        self.num_heads = kernel.num_heads
        self.num_kv_heads = kernel.num_kv_heads
        self.head_dim = kernel.head_size
        self.scaling = attn.scaling
        self.windows = layer_windows(config)
        self.softcaps = (getattr(config, "attn_logit_softcapping", None),) * self.num_layers  # Gemma 2: every layer
        self.qk_norm = qk_norm_kind(attn, self.head_dim)
        self.post_norms = hasattr(self.layers[0], "post_feedforward_layernorm")
        self.embedding_multiplier = getattr(
            config, "embedding_multiplier", None
        )  # Granite; Gemma's is in embed_input_ids
        self._split = [self.num_heads * self.head_dim, *[self.num_kv_heads * self.head_dim] * 2]
        weight = self.inner.embed_tokens.weight
        self.dtype = weight.dtype
        self.device = weight.device
        self.attn_modules = [block.self_attn.attn for block in self.layers]
        self._builders: dict = {}  # the backend's metadata builders per sliding window, made at first use
        self._kernel: bool | None = None  # whether connector jobs attend with the kernel, decided at first use
        self.attention_probe: dict[str, float] = {}  # what "auto" measured: ms for the kernel and for SDPA

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        embed = getattr(self.inner, "embed_input_ids", self.inner.embed_tokens)  # Gemma's scales in the former
        h = embed(ids)
        return h if self.embedding_multiplier is None else h * self.embedding_multiplier

    def rotary(self, positions: torch.Tensor) -> FusedRotary | TableRotary:
        if not self.fused_rotary:
            return table_rotary(self.inner.rotary_emb, self.config, positions, self.dtype, self.num_layers)
        return FusedRotary([block.self_attn.rotary_emb for block in self.layers], positions)

    def qkv(self, layer: int, hidden: torch.Tensor, queries: bool = True):
        # one fused projection: q comes with k and v, asked for or not
        block = self.layers[layer]
        attn = block.self_attn
        x = block.input_layernorm(hidden) if hasattr(block, "input_layernorm") else hidden  # OLMo 2 has none
        q, k, v = _output(attn.qkv_proj(x)).split(self._split, dim=-1)
        if self.qk_norm == "all":
            q, k = attn.q_norm(q), attn.k_norm(k)
        T = x.shape[0]
        q, k, v = (t.reshape(T, -1, self.head_dim) for t in (q, k, v))
        return heads_first(attn, q, k, v, qk_norm=self.qk_norm == "head")

    def finish(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        block = self.layers[layer]
        T = attn_out.shape[1]
        out = _output(block.self_attn.o_proj(attn_out.transpose(0, 1).reshape(T, -1)))
        return post_norm_finish(block, hidden, out, self.post_norms)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The blend pass never needs them (vLLM samples from its own forward); a live check's full
        prefill does. vLLM's logits processor (soft-capping, scaling, and under tensor parallelism
        the gather of every rank's vocabulary) makes them; on every rank, or the ranks would part."""
        logits = self.causal_lm.compute_logits(self.inner.norm(hidden))
        with agreed(self.tp):
            if logits is None:
                raise NotImplementedError("this platform gathers vLLM's logits to the first rank only")
        return logits.float()

    def attention_layer_names(self) -> list[str]:
        return [module.layer_name for module in self.attn_modules]

    def attention(self, positions: torch.Tensor, start: int, end: int, target: object | None) -> Attention:
        dense = DenseAttention(
            positions, start, end, windows=self.windows, scaling=self.scaling, dtype=self.dtype, softcaps=self.softcaps
        )
        if target is None:
            return dense
        assert isinstance(target, PagedCache), "a connector job's walk writes into a PagedCache"
        return PagedAttention(self, target, positions, start, end, dense)

    def kernel_builders(self) -> dict:
        """vLLM's attention metadata builders, one per sliding window (None:
        full attention), each for its layers as the model runner makes them,
        when connector jobs attend with the backend's kernel
        (``attends_with_kernel``); else none."""
        return self._builders if self.attends_with_kernel() else {}

    def attends_with_kernel(self) -> bool:
        """Whether connector jobs attend with the backend's kernel rather than
        SDPA: never on backends not in ``KERNEL_BACKENDS`` or where the kernel
        disagrees with SDPA on the probe; else as ``walk_attention`` says,
        "auto" measuring both once."""
        if self._kernel is None:
            self._kernel = False
            backend = self.attn_modules[0].attn_backend if self.vllm_config is not None else None
            if backend is not None and backend.get_name() in KERNEL_BACKENDS and self.walk_attention != "sdpa":
                groups: dict[int | None, list] = {}
                for module, window in zip(self.attn_modules, self.windows):
                    groups.setdefault(window, []).append(module)
                make = backend.get_builder_cls()
                self._builders = {
                    window: make(
                        modules[0].get_kv_cache_spec(self.vllm_config),
                        [m.layer_name for m in modules],
                        self.vllm_config,
                        self.device,
                    )
                    for window, modules in groups.items()
                }
                agrees, faster = self._probe_kernel(groups)
                self._kernel = agrees and (self.walk_attention == "kernel" or faster)
        return self._kernel

    @torch.inference_mode()
    def _probe_kernel(self, groups: dict[int | None, list]) -> tuple[bool, bool]:
        """Run the kernel and SDPA on an active set like a blend's at 0.15
        (every 7th token of a 2048-token prompt after its first 256, and the
        last 16) over the same random KV, written into scratch blocks of the
        layer's own cache layout by the backend's ``do_kv_cache_update``, best
        of 3 each, for a layer without a window if there is one. Returns
        whether the kernel's output agrees with SDPA's (``KERNEL_AGREEMENT``)
        and whether it is faster (``KERNEL_MARGIN``); logs both."""
        window = None if None in groups else next(iter(groups))
        module, builder = groups[window][0], self._builders[window]
        name = module.attn_backend.get_name()
        block_size = builder.block_size
        n = 2048
        positions = torch.cat([torch.arange(256, n - 16, 7), torch.arange(n - 16, n)]).to(self.device)
        H, Hkv, D, A = self.num_heads, self.num_kv_heads, self.head_dim, positions.numel()
        blocks = -(-n // block_size)
        bound = getattr(module, "kv_cache", None)  # the layer's cache as vLLM bound it: its layout
        if isinstance(bound, torch.Tensor) and bound.dim() == 4 and bound.shape[0] >= blocks:
            scratch = torch.empty_like(bound[:blocks])
        else:  # not bound yet: CPU_ATTN's and FlashAttention's layout, keys and values side by side
            scratch = torch.empty((blocks, Hkv, block_size, 2 * D), dtype=self.dtype, device=self.device)
        target = PagedCache([scratch], list(range(blocks)), block_size)
        slots = target.slots(n, self.device)
        K, V = (torch.randn(Hkv, n, D, dtype=self.dtype, device=self.device) for _ in range(2))
        module.impl.do_kv_cache_update(
            module, K.transpose(0, 1).contiguous(), V.transpose(0, 1).contiguous(), scratch, slots
        )
        metadata = builder.build(0, kernel_runs(positions, target, slots))
        q = torch.randn(H, A, D, dtype=self.dtype, device=self.device)
        softcap = self.softcaps[self.attn_modules.index(module)]  # the kernel caps as that layer does
        dense = DenseAttention(
            positions, 0, n, windows=[window], scaling=self.scaling, dtype=self.dtype, softcaps=[softcap]
        )
        query, out = q.transpose(0, 1).contiguous(), torch.empty(A, H, D, dtype=self.dtype, device=self.device)

        def kernel() -> torch.Tensor:
            module.impl.forward(module, query, None, None, scratch, metadata, out)
            return out.transpose(0, 1)

        def sdpa() -> torch.Tensor:
            return dense(0, q, K, V)

        times: dict[str, list[float]] = {"kernel": [], "sdpa": []}
        results: dict[str, torch.Tensor] = {}
        for _ in range(3):
            for label, run in (("kernel", kernel), ("sdpa", sdpa)):
                _synchronize(self.device)
                start = time.perf_counter()
                results[label] = run()
                _synchronize(self.device)
                times[label].append(time.perf_counter() - start)
        expected = results["sdpa"].float()
        error = float((results["kernel"].float() - expected).abs().max() / expected.abs().max().clamp(min=1e-6))
        agrees = error <= KERNEL_AGREEMENT.get(self.dtype, 3e-2)
        kernel_s, sdpa_s = min(times["kernel"]), min(times["sdpa"])
        self.attention_probe = {"kernel_ms": kernel_s * 1e3, "sdpa_ms": sdpa_s * 1e3, "kernel_error": error}
        faster = kernel_s <= sdpa_s * KERNEL_MARGIN
        if not agrees:
            logger.error(
                "blend pass attention: SDPA over the walk's dense KV; %s's kernel disagrees with SDPA on the probe "
                "(largest difference %.3g of the largest output), so it is not used",
                name,
                error,
            )
            return False, faster
        logger.info(
            "blend pass attention: %s (on a blend-like active set, %s kernel %.1f ms, SDPA %.1f ms; they agree "
            "to %.2g)",
            f"{name}'s kernel" if faster or self.walk_attention == "kernel" else "SDPA over the walk's dense KV",
            name,
            kernel_s * 1e3,
            sdpa_s * 1e3,
            error,
        )
        return True, faster


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU's kernels run asynchronously), so that timings are of the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _output(result) -> torch.Tensor:
    """A vLLM linear layer's output: ``(output, bias)`` in vLLM's own models,
    the output alone in its Transformers backend."""
    return result[0] if isinstance(result, tuple) else result


class FusedRotary:
    """RoPE with each layer's vLLM rotary module (its fused kernel, in
    place), which takes token-major rows ``[n, heads * D]``: the walk's
    heads-first tensors are views of such rows (the projections' output) or,
    for the reused keys of the dense cache, one row block per head."""

    def __init__(self, ropes: list, positions: torch.Tensor) -> None:
        self.ropes, self.positions = ropes, positions
        self._rows: torch.Tensor | None = None
        self._at = positions

    def _apply(self, rope, positions: torch.Tensor, rows: torch.Tensor) -> None:
        out, _ = rope(positions, rows)
        if out.data_ptr() != rows.data_ptr():  # an out-of-place implementation
            rows.copy_(out)

    def __call__(self, layer: int, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        if rows is not self._rows:  # the walk passes one rows tensor per active set
            self._rows, self._at = rows, (self.positions if rows is None else self.positions[rows])
        rope = self.ropes[layer]
        heads, n, d = x.shape
        tokens = x.transpose(0, 1)
        if tokens.stride(1) == d and tokens.stride(2) == 1:  # token-major memory: every head at once
            self._apply(rope, self._at, tokens.view(n, heads * d))
        elif x.stride(1) == d and x.stride(2) == 1:  # heads-first memory: a call per head
            for head in x:
                self._apply(rope, self._at, head)
        else:
            return self(layer, x.contiguous(), rows)
        return x


def kernel_runs(positions: torch.Tensor, target: PagedCache, slots: torch.Tensor):
    """The kernel's batch for active queries at sorted ``positions`` in
    ``target``'s blocks (``slots``: their cache slots): each run of
    consecutive positions is one sequence, whose bottom-right causal mask is
    then exact by absolute position."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    pos = positions.to(device="cpu", dtype=torch.int32)
    breaks = torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1
    ends = torch.cat([breaks, torch.tensor([pos.numel()])]).to(torch.int32)
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), ends])
    seq_lens = pos[ends.long() - 1] + 1
    device = slots.device
    blocks = torch.tensor(target.block_ids, dtype=torch.int32, device=device)
    return CommonAttentionMetadata(
        query_start_loc=starts.to(device),
        query_start_loc_cpu=starts,
        seq_lens=seq_lens.to(device),
        num_reqs=ends.numel(),
        num_actual_tokens=pos.numel(),
        max_query_len=int((ends - starts[:-1]).max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=blocks.expand(ends.numel(), -1).contiguous(),
        slot_mapping=slots[positions.long()].to(torch.int64),
        causal=True,
    )


class PagedAttention:
    """The walk's attention in a connector job. Each layer's complete KV (the
    new tokens' rows) is written into the request's blocks with the backend's
    ``do_kv_cache_update``, as vLLM writes it. Then the active queries attend
    those blocks with the backend's kernel: each run of consecutive positions
    is one sequence of the kernel's batch, whose bottom-right causal mask is
    then exact by absolute position, and so is each layer's sliding window
    (one metadata per window). Where the kernel is not used
    (``VLLMDecoder.attends_with_kernel``) they attend with ``dense`` instead."""

    def __init__(self, decoder: VLLMDecoder, target: PagedCache, positions, start, end, dense) -> None:
        self.decoder, self.target, self.start, self.end, self.dense = decoder, target, start, end, dense
        self.slots = target.slots(end, decoder.device)
        builders = decoder.kernel_builders()
        runs = kernel_runs(positions, target, self.slots) if builders else None
        self.metadata = {window: builder.build(0, runs) for window, builder in builders.items()}

    def store(self, layer: int, K: torch.Tensor, V: torch.Tensor) -> None:
        module = self.decoder.attn_modules[layer]
        rows = slice(self.start, self.end)
        with record_function("walk.paged_write"):
            key = K[:, rows].transpose(0, 1).contiguous()  # [n, kv_heads, head_dim], as vLLM writes it
            value = V[:, rows].transpose(0, 1).contiguous()
            module.impl.do_kv_cache_update(module, key, value, self.target.kv_caches[layer], self.slots[rows])

    def __call__(self, layer: int, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
        self.store(layer, K, V)
        metadata = self.metadata.get(self.decoder.windows[layer])
        if metadata is None:
            return self.dense(layer, q, K, V)
        module = self.decoder.attn_modules[layer]
        query = q.transpose(0, 1).contiguous()  # [A, heads, head_dim]
        out = torch.empty_like(query)
        module.impl.forward(module, query, None, None, self.target.kv_caches[layer], metadata, out)
        return out.transpose(0, 1)
