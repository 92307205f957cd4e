"""nn.RNN / nn.LSTM / nn.GRU on the simulated GPU take cuDNN's path, as on a real GPU.

A CPU-only build has no cuDNN: ``at::cudnn_is_acceptable`` is false, so an RNN on a fake
'cuda' tensor takes the native path -- one fused cell per time step
(``_thnn_fused_gru_cell``, CUDA-only kernels without meta kernels: refused) -- and
``flatten_parameters`` keeps the weights apart.  A CUDA build runs the whole stack as
one ``aten::_cudnn_rnn`` (backward: ``aten::_cudnn_rnn_backward``) on weights flattened
into one buffer.  This patch does what the CUDA build does:

- ``torch.backends.cudnn.is_acceptable`` and ``torch._use_cudnn_rnn_flatten_weight`` say
  yes for fake CUDA tensors (while ``torch.backends.cudnn.enabled``), and
  ``torch._cudnn_rnn_flatten_weight`` makes one buffer and points the parameters into it;
- ``torch._VF.rnn_tanh/rnn_relu/lstm/gru`` (what the modules call; dense or packed input)
  call ``aten::_cudnn_rnn`` as ``_cudnn_impl`` in aten/src/ATen/native/cudnn/RNN.cpp
  does, with the flat buffer when the weights are views of one (else the op flattens a
  copy), the dropout state (``_cudnn_init_dropout_state``, one per device, kept) and,
  under CUDA autocast, what ``_cudnn_rnn_cast_reflatten`` does (a 16-bit flat copy of the
  weights, the input and hidden state cast);
- fake kernels give those ops the outputs and sizes measured on an H100 (cuDNN 9.19,
  torch 2.11; ``RULES``), and cuDNN's workspace -- no tensor, allocated and freed inside
  the forward and again inside the backward -- is a ``memadvisor::cudnn_rnn_workspace``
  tensor made around each call.
"""
from __future__ import annotations

import math

from .patching import Patches

# --- the rules, measured ---------------------------------------------------------------
RULES = """\
Measured on an H100 80GB (132 SMs; torch 2.11.0+cu130, cuDNN 9.19.0), 279 configurations
(RNN_TANH/RNN_RELU/LSTM/GRU, 1-4 layers, one or two directions, hidden 16-1024, input
8-300, batch 1-1000, 1-300 steps, dense and packed, fp32/fp16/bf16/autocast, dropout,
LSTM proj_size), allocations read from torch.cuda.memory history:

reserve (saved for backward) = tokens * D * (G * L * H + (L - 1) * H) * elem + 256 bytes
    tokens = sum of lengths (packed) or T * B; D directions; L layers; H hidden size;
    G = 1 (RNN), 5 (LSTM), 6 (GRU); LSTM with proj_size P: D * L * (6H + P) instead of
    D * G * L * H; with dropout p > 0 in training: + (L - 1) * T * B * D * H / 4 bytes
    (T steps, B the largest batch).  Exact in 274 of 279 cases, the rest within 40 B.
workspace (forward, and twice in backward, freed each time) ~= L * D * 8 MiB
    + weights * elem + tokens * elem * c, c fitted per token (log-linear in H, E, D, L,
    packed, mode): median error 2%, 90th percentile 16%, worst 67% (a large-batch
    E=300 LSTM); the fixed 8 MiB per layer and direction dominates small models.
dropout state: 48 KiB per SM (6,488,064 B on 132 SMs), made once per device, kept.
weight buffer: the parameters' own elements (no padding), dtype of the weights."""

_WORKSPACE_PER_LAYER = 8 << 20
_RESERVE_EXTRA = 256
_DROPOUT_STATE_PER_SM = 48 << 10
_GATE_BLOCKS = {0: 1, 1: 1, 2: 5, 3: 6}  # cuDNN mode: RNN_RELU, RNN_TANH, LSTM, GRU
#: log(c) = k . features, least squares over the 279 measurements (c: workspace bytes per
#: token and element byte beyond the fixed and weight parts; features in workspace_bytes)
_WS_COEF = (0.1254, 1.6099, -0.1348, 0.1128, 0.7293, 0.0601, -0.8184, 0.1808, 0.3095, 0.4117)
_MODES = {"rnn_relu": 0, "rnn_tanh": 1, "lstm": 2, "gru": 3}
#: nn.RNNBase.mode -> cudnnRNNMode_t (torch.backends.cudnn.rnn.get_cudnn_mode needs cuDNN)
_CUDNN_MODES = {"RNN_RELU": 0, "RNN_TANH": 1, "LSTM": 2, "GRU": 3}


def reserve_bytes(mode: int, tokens: int, steps: int, batch: int, hidden: int, proj: int,
                  layers: int, directions: int, elem: int, dropout: float, train: bool) -> int:
    if not train:
        return 0
    if mode == 2 and proj:
        per_token = directions * layers * (6 * hidden + proj)
    else:
        per_token = directions * layers * _GATE_BLOCKS[mode] * hidden
    per_token += (layers - 1) * directions * hidden
    nbytes = tokens * per_token * elem + _RESERVE_EXTRA
    if dropout > 0:
        nbytes += (layers - 1) * steps * batch * directions * hidden // 4
    return nbytes


def workspace_bytes(mode: int, tokens: int, input_size: int, hidden: int, layers: int,
                    directions: int, packed: bool, weight_elems: int, elem: int) -> int:
    h = math.log(min(max(hidden, 16), 1024))
    features = (1.0, h, h * h, math.log(max(input_size, 1)), math.log(directions),
                math.log(layers), float(packed), float(mode == 3), float(mode == 2),
                math.log(max(input_size, hidden * directions)))
    per_token = math.exp(sum(k * f for k, f in zip(_WS_COEF, features)))
    per_token *= max(1.0, hidden / 1024)  # beyond the measured range: linear in H
    return int(layers * directions * _WORKSPACE_PER_LAYER + weight_elems * elem
               + tokens * elem * per_token)


def dropout_state_bytes(multi_processor_count: int) -> int:
    return _DROPOUT_STATE_PER_SM * multi_processor_count


# --- fake kernels ------------------------------------------------------------------------
def _shape_info(input, batch_first, bidirectional, batch_sizes):
    packed = len(batch_sizes) != 0
    if packed:
        steps, batch, tokens = len(batch_sizes), int(batch_sizes[0]), input.shape[0]
    else:
        steps = input.shape[1] if batch_first else input.shape[0]
        batch = input.shape[0] if batch_first else input.shape[1]
        tokens = steps * batch
    return packed, int(steps), int(batch), int(tokens), 2 if bidirectional else 1


def _cudnn_rnn_fake(input, weight, weight_stride0, weight_buf, hx, cx, mode, hidden_size,
                    proj_size, num_layers, batch_first, dropout, train, bidirectional,
                    batch_sizes, dropout_state):
    import torch
    packed, steps, batch, tokens, dirs = _shape_info(input, batch_first, bidirectional,
                                                     batch_sizes)
    out_size = proj_size or hidden_size
    if packed:
        out_shape = (tokens, out_size * dirs)
    elif batch_first:
        out_shape = (batch, steps, out_size * dirs)
    else:
        out_shape = (steps, batch, out_size * dirs)
    output = input.new_empty(out_shape)
    hy = hx.new_empty((num_layers * dirs, batch, out_size))
    cy = (cx.new_empty((num_layers * dirs, batch, hidden_size)) if cx is not None
          else input.new_empty((0,)))
    nbytes = reserve_bytes(mode, tokens, steps, batch, hidden_size, proj_size, num_layers,
                           dirs, input.element_size(), dropout, train)
    reserve = input.new_empty((nbytes,), dtype=torch.uint8)
    if weight_buf is None:  # the op flattens the weights into a buffer of its own
        weight_buf = weight[0].new_empty((sum(w.numel() for w in weight),))
    return output, hy, cy, reserve, weight_buf


def _cudnn_rnn_backward_fake(input, weight, weight_stride0, weight_buf, hx, cx, output,
                             grad_output, grad_hy, grad_cy, mode, hidden_size, proj_size,
                             num_layers, batch_first, dropout, train, bidirectional,
                             batch_sizes, dropout_state, reserve, output_mask):
    # the data pass makes dx, dhx (and dcx) whatever the mask (_cudnn_rnn_backward_input)
    dx = input.new_empty(input.shape)
    dhx = hx.new_empty(hx.shape)
    dcx = cx.new_empty(cx.shape) if cx is not None else hx.new_empty((0,))
    dw = []
    if output_mask[3]:
        # one flat buffer, the gradients views of it (as _cudnn_rnn_backward_weight)
        flat = weight_buf.new_empty((sum(w.numel() for w in weight),))
        offset = 0
        for w in weight:
            dw.append(flat[offset:offset + w.numel()].view(w.shape))
            offset += w.numel()
    return dx, dhx, dcx, dw


def _flatten_fake(weight_arr, weight_stride0, input_size, mode, hidden_size, proj_size,
                  num_layers, batch_first, bidirectional):
    return weight_arr[0].new_empty((sum(w.numel() for w in weight_arr),))


def _dropout_state_fake(state):
    def fake(dropout, train, dropout_seed, *, dtype=None, layout=None, device=None,
             pin_memory=False):
        import torch
        return torch.empty((state["dropout_state_bytes"],), dtype=torch.uint8, device=device)
    return fake


_WORKSPACE_LIB = None


def _workspace_op():
    """``memadvisor::cudnn_rnn_workspace(Tensor like, int nbytes) -> Tensor``: the block
    cuDNN takes from the caching allocator for one call (defined once per process)."""
    global _WORKSPACE_LIB
    import torch
    if _WORKSPACE_LIB is None:
        lib = torch.library.Library("memadvisor", "FRAGMENT")
        lib.define("cudnn_rnn_workspace(Tensor like, int nbytes) -> Tensor")

        def real(like, nbytes):
            return torch.empty((nbytes,), dtype=torch.uint8, device=like.device)
        lib.impl("cudnn_rnn_workspace", real, "CompositeExplicitAutograd")
        torch.library.register_fake("memadvisor::cudnn_rnn_workspace", lib=lib)(
            lambda like, nbytes: like.new_empty((nbytes,), dtype=torch.uint8))
        _WORKSPACE_LIB = lib
    return torch.ops.memadvisor.cudnn_rnn_workspace.default


# --- the Python side: what the modules call ----------------------------------------------
def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _flat_buffer_of(weights):
    """A 1-D tensor over the weights' storage when they lie in it back to back, in order
    (``try_get_weight_buf``), else None."""
    first = weights[0]
    storage = first.untyped_storage()._cdata
    start = offset = first.storage_offset()
    for w in weights:
        if (w.untyped_storage()._cdata != storage or w.storage_offset() != offset
                or not w.is_contiguous()):
            return None
        offset += w.numel()
    return first.detach().as_strided((offset - start,), (1,), start)


def _flatten_parameters(original):
    """``RNNBase.flatten_parameters`` telling the weights apart by storage and offset: a
    fake tensor has no data pointer (the original's aliasing check reads them)."""
    def flatten_parameters(self) -> None:
        import torch
        weights = self._flat_weights
        if (len(weights) != len(self._flat_weights_names)
                or not all(isinstance(w, torch.Tensor) for w in weights)
                or not all(torch._subclasses.fake_tensor.is_fake(w) for w in weights)):
            return original(self)
        dtype = weights[0].dtype
        if not all(w.dtype == dtype and w.is_cuda and torch.backends.cudnn.is_acceptable(w)
                   for w in weights):
            return None
        places = {(w.untyped_storage()._cdata, w.storage_offset()) for w in weights}
        if len(places) != len(weights):
            return None  # aliasing weights: the copying path, as the original
        with torch.no_grad():
            num_weights = (4 if self.bias else 2) + (1 if self.proj_size > 0 else 0)
            torch._cudnn_rnn_flatten_weight(
                weights, num_weights, self.input_size, _CUDNN_MODES[self.mode],
                self.hidden_size, self.proj_size, self.num_layers, self.batch_first,
                bool(self.bidirectional))
        return None
    flatten_parameters.__wrapped__ = original
    return flatten_parameters


class CudnnRnn:
    def __init__(self, multi_processor_count: int):
        import torch
        self.patches = Patches()
        self.state = {"dropout_state_bytes": dropout_state_bytes(multi_processor_count)}
        self._dropout_states: dict = {}
        self._workspace = _workspace_op()
        self._lib = torch.library.Library("aten", "IMPL")
        registry = torch._library.simple_registry.singleton
        self._handles = []
        for name, fn in (("aten::_cudnn_rnn", _cudnn_rnn_fake),
                         ("aten::_cudnn_rnn_backward", _cudnn_rnn_backward_fake),
                         ("aten::_cudnn_rnn_flatten_weight", _flatten_fake),
                         ("aten::_cudnn_init_dropout_state", _dropout_state_fake(self.state))):
            self._handles.append(registry.find(name).fake_impl.register(fn, __name__, self._lib))
        original_acceptable = torch.backends.cudnn.is_acceptable

        def is_acceptable(tensor):
            if (isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda"
                    and torch.backends.cudnn.enabled):
                return tensor.dtype in (torch.float16, torch.bfloat16, torch.float32,
                                        torch.float64)
            return original_acceptable(tensor)
        self.patches.set(torch.backends.cudnn, "is_acceptable", is_acceptable)
        self.patches.set(torch, "_use_cudnn_rnn_flatten_weight", lambda: True)
        self.patches.set(torch, "_cudnn_rnn_flatten_weight", self._flatten)
        rnn_base = torch.nn.modules.rnn.RNNBase
        self.patches.set(rnn_base, "flatten_parameters", _flatten_parameters(
            rnn_base.flatten_parameters))
        from torch import _VF
        for name, mode in _MODES.items():
            original = getattr(_VF, name)
            self.patches.set(_VF, name, self._vf(name, mode, original))

    # flatten_parameters
    def _flatten(self, weight_arr, weight_stride0, input_size, mode, hidden_size, proj_size,
                 num_layers, batch_first, bidirectional):
        import torch
        buf = torch.ops.aten._cudnn_rnn_flatten_weight(
            weight_arr, weight_stride0, input_size, mode, hidden_size, proj_size, num_layers,
            batch_first, bidirectional)
        offset = 0
        storage = buf.untyped_storage()
        with torch.no_grad():
            for w in weight_arr:
                w.set_(storage, offset, w.shape, _contiguous_strides(w.shape))
                offset += w.numel()
        return buf

    def _vf(self, name, mode, original):
        def call(*args):
            import torch
            data = args[0]
            lstm = mode == 2
            # packed: (data, batch_sizes, hx, params, ...); dense: (input, hx, params, ...)
            packed = (isinstance(args[1], torch.Tensor) and
                      (lstm or isinstance(args[2], torch.Tensor)))
            if not (isinstance(data, torch.Tensor) and data.device.type == "cuda"
                    and torch.backends.cudnn.enabled
                    and data.dtype in (torch.float16, torch.bfloat16, torch.float32,
                                       torch.float64)):
                return original(*args)
            if packed:
                (_, batch_sizes, hx, params, has_biases, num_layers, dropout, train,
                 bidirectional) = args
                batch_first = False
            else:
                (_, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                 batch_first) = args
                batch_sizes = None
            return self._run(mode, data, batch_sizes, hx, list(params), has_biases,
                             num_layers, dropout, train, bidirectional, batch_first)
        call.__wrapped__ = original
        return call

    def _run(self, mode, input, batch_sizes, hx, params, has_biases, num_layers, dropout,
             train, bidirectional, batch_first):
        import torch
        lstm = mode == 2
        h, c = (hx[0], hx[1]) if lstm else (hx, None)
        dirs = 2 if bidirectional else 1
        weight_stride0 = len(params) // (num_layers * dirs)  # w_ih, w_hh[, b_ih, b_hh][, w_hr]
        has_proj = weight_stride0 in (3, 5)
        if has_proj:
            proj_size, hidden_size = params[weight_stride0 - 1].shape
        else:
            proj_size, hidden_size = 0, params[1].shape[1]
        weight_buf = _flat_buffer_of(params)
        if torch.is_autocast_enabled("cuda"):
            low = torch.get_autocast_dtype("cuda")
            if input.dtype != low:  # _cudnn_rnn_cast_reflatten
                input = input.to(low)
                h = h.to(low)
                c = c.to(low) if c is not None else None
            if params[0].dtype != low:
                flat = params[0].new_empty((sum(p.numel() for p in params),), dtype=low)
                views, offset = [], 0
                for p in params:
                    view = flat[offset:offset + p.numel()].view(p.shape)
                    view.copy_(p)
                    views.append(view)
                    offset += p.numel()
                params, weight_buf = views, flat.detach()
        with torch.autocast("cuda", enabled=False):
            return self._call(mode, input, batch_sizes, h, c, params, weight_stride0,
                              weight_buf, hidden_size, proj_size, num_layers, dropout, train,
                              bidirectional, batch_first)

    def _call(self, mode, input, batch_sizes, h, c, params, weight_stride0, weight_buf,
              hidden_size, proj_size, num_layers, dropout, train, bidirectional, batch_first):
        import torch
        dirs = 2 if bidirectional else 1
        sizes = [] if batch_sizes is None else [int(b) for b in batch_sizes.tolist()]
        packed = bool(sizes)
        if packed:
            tokens = input.shape[0]
        else:
            tokens = input.shape[0] * input.shape[1]
        input_size = input.shape[-1]
        dropout_state = None
        if dropout > 0 and train:
            key = (input.device, "state")
            dropout_state = self._dropout_states.get(key)
            if dropout_state is None:
                dropout_state = torch.ops.aten._cudnn_init_dropout_state(
                    dropout, train, 0, dtype=torch.uint8, device=input.device)
                self._dropout_states[key] = dropout_state
        weight_elems = sum(p.numel() for p in params)
        nbytes = workspace_bytes(mode, tokens, input_size, hidden_size, num_layers, dirs,
                                 packed, weight_elems, input.element_size())
        if batch_first and not packed:
            nbytes += input.numel() * input.element_size()  # input.contiguous() seq-first
        workspace = self._workspace(input, nbytes)
        output, hy, cy, reserve, _ = torch.ops.aten._cudnn_rnn(
            input, params, weight_stride0, weight_buf, h, c, mode, hidden_size, proj_size,
            num_layers, batch_first, dropout, train, bidirectional, sizes, dropout_state)
        del workspace
        node = output.grad_fn
        if node is not None:
            self._backward_workspace(node, input, h, c, output, nbytes)
        if mode == 2:
            return output, hy, cy
        return output, hy

    def _backward_workspace(self, node, input, h, c, output, nbytes):
        """cuDNN's workspace inside ``_cudnn_rnn_backward`` (made for the data pass and
        again for the weights pass: the peak holds one), plus the zeros the op makes for
        the gradients that did not come (an unused hy/cy, an unused output)."""
        workspace = self._workspace
        held = []
        shapes = (output, h, c)

        def before(grad_outputs):
            extra = 0
            for grad, like in zip(grad_outputs, shapes):
                if grad is None and like is not None:
                    extra += like.numel() * like.element_size()
            held.append(workspace(input, nbytes + extra))

        def after(grad_inputs, grad_outputs):
            held.clear()
        node.register_prehook(before)
        node.register_hook(after)

    def undo(self) -> None:
        self.patches.undo()
        for handle in self._handles:
            handle.destroy()
        self._lib._destroy()
        self._dropout_states.clear()


def install(multi_processor_count: int = 132) -> CudnnRnn:
    return CudnnRnn(multi_processor_count)
