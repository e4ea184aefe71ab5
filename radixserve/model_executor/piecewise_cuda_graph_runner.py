"""Piecewise CUDA graphs for EXTEND forwards (prefills and mixed batches).

An eager extend launches some fifteen kernels a layer from Python. A small
one (a mixed step of a few hundred prompt tokens, a short prompt) is then
bound by the host: on an 8B model a 512-token mixed step spends about 63 ms
launching for 15 ms on the GPU (benchmarks/README.md, E7). A whole extend cannot
be one graph, because attention depends on the batch's layout (how many
requests, their prefix and extend lengths). Everything else in a layer is
row-wise (projections, norms, rotary, the MLP, the TP all-reduces) and
depends only on the token count.

So the runner cuts the forward at each layer's attention and captures the
pieces between, once per token count in ``token_sizes`` (by default
``server_args.piecewise_token_sizes``):

- piece 0: embedding, layer 0 up to its q/k/v;
- piece i (1..L-1): layer i-1 after its attention (o_proj, norm, MLP), then
  layer i up to its q/k/v;
- piece L: the last layer after its attention, then the final norm.

A batch of ``n`` tokens is padded to the smallest captured size ``T >= n``.
Each piece reads and writes static buffers of ``T`` rows; between pieces
attention runs eagerly on the first ``n`` rows only, with the batch's own
metadata, and stores K/V only for real tokens. Padding rows carry whatever an
earlier batch left there: no piece mixes rows, so they never reach a real
token. The LM head runs eagerly on the ``n`` rows it needs.

Under tensor parallelism the pieces hold the layers' all-reduces: every rank
captures the same sizes in the same order and replays the same sizes. All
pieces share one memory pool; their outputs are copied into the static
buffers, so no piece's memory outlives its replay.

``use_graphs=False`` runs the same pieces eagerly on the same buffers (any
device): the CPU tests check the cutting and padding through it.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Callable

import torch

from radixserve.layers.logits_processor import LogitsProcessorOutput
from radixserve.model_executor.cuda_graph_runner import GraphCapturer, ModelRunnerView
from radixserve.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)

def supports_pieces(model: torch.nn.Module) -> bool:
    """Whether ``model`` has the Llama-family layout the runner cuts: a body
    with ``embed_tokens``, ``layers`` split by ``before_attention`` /
    ``after_attention``, and ``norm`` (all of it: not a pipeline stage, which
    lacks some of these)."""
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    return (
        all(getattr(body, name, None) is not None for name in ("embed_tokens", "norm")) and bool(layers)
        and all(hasattr(layer, "before_attention") and hasattr(layer, "after_attention") for layer in layers)
        and all(getattr(model, name, None) is not None for name in ("lm_head", "logits_processor"))
    )


class PiecewiseCudaGraphRunner:
    def __init__(self, model_runner: ModelRunnerView, token_sizes: list[int], use_graphs: bool = True):
        if not token_sizes or min(token_sizes) < 1:
            raise ValueError(f"piecewise CUDA graph token sizes must be positive, got {token_sizes}")
        self.runner = model_runner
        self.model = model_runner.model
        self.body = self.model.model
        self.layers = list(self.body.layers)
        self.token_sizes = sorted(set(token_sizes))
        self.max_tokens = self.token_sizes[-1]
        self._init_buffers()
        manager = model_runner.lora_manager
        # --enable-lora: the segmented LoRA kernels' table is an input of every piece
        self.lora = manager.static_table(self.max_tokens) if use_graphs and manager is not None else None
        self.pieces: dict[int, list[Callable[[], None]]] = {}
        start = time.perf_counter()
        if use_graphs:
            capturer = GraphCapturer(model_runner.device, model_runner.tp_size)
            with torch.inference_mode():
                for t in reversed(self.token_sizes):  # largest first: the pool is sized once
                    if self.lora is not None:
                        manager.capture_with(self.lora, t)
                    self.pieces[t] = [capturer.capture(fn, warmups=1)[0].replay for fn in self._piece_fns(t)]
            if self.lora is not None:
                manager.activate(None)
            # Capturing ran every piece on whatever the buffers held: start clean.
            for buf in (self.input_ids, self.positions, self.residual, self.attn_out):
                buf.zero_()
            logger.info("captured piecewise CUDA graphs (%d pieces each) for %d token counts up to %d in %.1f s",
                        len(self.layers) + 1, len(self.token_sizes), self.max_tokens, time.perf_counter() - start)
        else:
            self.pieces = {t: self._piece_fns(t) for t in self.token_sizes}

    def _init_buffers(self) -> None:
        r, n = self.runner, self.max_tokens
        attn = self.layers[0].self_attn
        hidden = self.model.config.hidden_size
        kw = dict(dtype=r.dtype, device=r.device)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=r.device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=r.device)
        self.q = torch.zeros(n, attn.q_size, **kw)
        self.k = torch.zeros(n, attn.kv_size, **kw)
        self.v = torch.zeros(n, attn.kv_size, **kw)
        self.attn_out = torch.zeros(n, attn.num_heads * attn.head_dim, **kw)
        self.residual = torch.zeros(n, hidden, **kw)
        self.hidden = torch.zeros(n, hidden, **kw)

    # -- the pieces ------------------------------------------------------------
    def _piece_fns(self, t: int) -> list[Callable[[], None]]:
        """The ``len(layers) + 1`` pieces for ``t`` tokens, each reading and
        writing the first ``t`` rows of the static buffers."""
        return [self._first_piece(t)] + [self._middle_piece(i, t) for i in range(1, len(self.layers))] + [
            self._last_piece(t)]

    def _first_piece(self, t: int) -> Callable[[], None]:
        def run() -> None:
            hidden = self.body.embed_tokens(self.input_ids[:t])
            self._keep(t, *self.layers[0].before_attention(self.positions[:t], hidden, None))
        return run

    def _middle_piece(self, i: int, t: int) -> Callable[[], None]:
        def run() -> None:
            hidden, residual = self.layers[i - 1].after_attention(self.attn_out[:t], self.residual[:t])
            self._keep(t, *self.layers[i].before_attention(self.positions[:t], hidden, residual))
        return run

    def _last_piece(self, t: int) -> Callable[[], None]:
        def run() -> None:
            hidden, residual = self.layers[-1].after_attention(self.attn_out[:t], self.residual[:t])
            self.hidden[:t].copy_(self.body.norm(hidden, residual)[0])
        return run

    def _keep(self, t: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, residual: torch.Tensor) -> None:
        for buf, value in ((self.q, q), (self.k, k), (self.v, v), (self.residual, residual)):
            buf[:t].copy_(value)

    # -- running -----------------------------------------------------------------
    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.forward_mode.is_extend() and 0 < fb.num_tokens <= self.max_tokens

    def padded_size(self, num_tokens: int) -> int:
        return self.token_sizes[bisect.bisect_left(self.token_sizes, num_tokens)]

    def forward(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        """The model's forward of the EXTEND ``fb``: pieces replayed at the
        padded size, attention eager on the real rows. No host sync."""
        n, t = fb.num_tokens, self.padded_size(fb.num_tokens)
        pieces = self.pieces[t]
        if self.lora is not None:
            self.lora.fill(None if fb.lora is None else fb.lora.row_slots, t)
        self.input_ids[:n].copy_(fb.input_ids)
        self.positions[:n].copy_(fb.positions)
        self.runner.attn_backend.init_forward_metadata(fb)
        pieces[0]()
        q, k, v, attn_out = self.q[:n], self.k[:n], self.v[:n], self.attn_out[:n]  # the same rows every layer
        for layer, piece in zip(self.layers, pieces[1:]):
            attn_out.copy_(layer.self_attn.attn(q, k, v, fb))
            piece()
        return self.model.logits_processor(fb.input_ids, self.hidden[:n], self.model.lm_head, fb)
