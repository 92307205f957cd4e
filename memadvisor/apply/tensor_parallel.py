"""``tp=T`` (and ``sp``): tensor parallelism with PyTorch's own ``parallelize_module``.

The model's attention and MLP blocks are recognised by the names of their Linear children
(as torchtitan's ``parallelize_llama`` names ``wq/wk/wv/wo`` and ``w1/w2/w3`` by hand, but
for the spellings common models use), then split the Megatron way over the T ranks of a
tensor-parallel group:

==========================  =========================================================
attention q, k, v           ``ColwiseParallel``: each rank computes its heads
attention output            ``RowwiseParallel``: partial sums all-reduced
MLP up (and gate)           ``ColwiseParallel``: each rank holds a slice of the hidden
MLP down                    ``RowwiseParallel``
with ``sp``                 norms inside the blocks ``SequenceParallel``; the residual
                            stream holds this rank's part of the sequence (dimension
                            1) from the first block's input (cut) to the last block's
                            output (gathered); each column-parallel Linear all-gathers
                            its input (``input_layouts=Shard(1)``), each row-parallel
                            one reduce-scatters its output (``output_layouts=Shard(1)``)
==========================  =========================================================

Attention code reshapes with its head count (``view(B, T, self.n_heads, head_dim)``); the
local q/k/v hold ``n_heads / T`` heads, so, as torchtitan sets ``n_heads //= tp`` on each
attention module, the head-count attributes found on the module are divided.  An
attention module whose head count cannot be found is refused.  A fused ``qkv`` Linear
(one output holding q, k and v) is left replicated, with the reason, where its split of
rows cannot be made to follow heads (ColwiseParallel would hand rank 0 all of q and half
of k); the blocks' MLPs are split all the same.

The token embedding and the LM head are split along the vocabulary, as torchtitan's
``parallelize_llama`` does (``plan.tensor_parallel_vocabulary`` finds them, simulate too):

==========================  =========================================================
token embedding             ``RowwiseParallel``: each rank holds V/T rows, looks up the
                            ids in its range, zeros the rest; the partial outputs are
                            all-reduced (``output_layouts=Replicate()``, also with
                            ``sp``: the model may add a position embedding to it before
                            the first block, where the sequence is cut)
LM head                     ``ColwiseParallel(output_layouts=Replicate())``: each rank
                            computes V/T logits, all-gathered along the vocabulary; the
                            script computes its loss on the whole logits (torchtitan's
                            ``loss_parallel`` would need the script's cross-entropy call
                            inside its context, on DTensor logits)
==========================  =========================================================

A weight tied between the two (GPT, nanoGPT: ``lm_head.weight = tok_emb.weight``) is split
the same way by both styles (rows = vocabulary, ``Shard(0)``), so, as PyTorch's own TP
test model does, the head's weight is set back to the embedding's DTensor after both are
split: one parameter, one gradient, shared.  An embedding with ``padding_idx``, ``max_norm``
or sparse gradients stays replicated with the reason (the local lookup would apply them
to global ids).  The final norm stays replicated (and the blocks' norms without ``sp``):
every rank holds it whole and computes the same gradient, since every rank of a group
sees the same batch; with ``sp`` the head would gather its input anyway.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..plan import (ModuleEntry, Plan, PlanError, TensorParallelBlocks,
                    tensor_parallel_blocks, tensor_parallel_vocabulary)

#: attributes holding a head count the attention's forward reshapes with
HEAD_ATTRIBUTES = ("n_head", "n_heads", "num_heads", "num_attention_heads", "n_kv_heads",
                   "n_kv_head", "num_kv_heads", "num_key_value_heads", "n_local_heads",
                   "n_local_kv_heads")
#: norm classes ``sp`` splits along the sequence (any class whose name ends so)
NORM_SUFFIXES = ("LayerNorm", "RMSNorm")


@dataclass
class Layout:
    """What ``tp`` splits in one model: module paths and the child names of each role."""
    attention: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    mlp: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    heads: dict[str, dict[str, int]] = field(default_factory=dict)  #: path -> attr -> count
    kept: dict[str, str] = field(default_factory=dict)  #: path -> why it stays replicated
    embedding: str | None = None  #: the token embedding split along the vocabulary
    head: str | None = None  #: the LM head split along the vocabulary
    tied: bool = False  #: the head's weight is the embedding's
    vocabulary_kept: dict[str, str] = field(default_factory=dict)  #: path -> why whole
    #: under ``sp``: the stream cut along the sequence / gathered whole again (a pipeline
    #: stage's dry run enters and leaves the stack at its own blocks)
    sequence_cut: object = None
    sequence_whole: object = None

    def linear_paths(self) -> dict[str, str]:
        """Every split Linear: path -> 'colwise' | 'rowwise'."""
        styles = TensorParallelBlocks(self.attention, self.mlp, self.kept).linear_styles()
        if self.head is not None:
            styles[self.head] = "colwise"
        return styles

    def split_paths(self) -> list[str]:
        """Every module whose weight is sharded: the split Linears and the embedding."""
        return list(self.linear_paths()) + ([self.embedding] if self.embedding else [])


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def find_layout(model: nn.Module, tp: int) -> Layout:
    """The attention and MLP blocks of ``model`` (``plan.tensor_parallel_blocks``, which
    simulate uses too) and how they split over ``tp`` ranks, or PlanError naming what
    cannot be split."""
    entries = [ModuleEntry(path, "Linear" if isinstance(m, nn.Linear) else type(m).__name__,
                           sum(p.numel() for p in m.parameters()))
               for path, m in model.named_modules()]
    blocks = tensor_parallel_blocks(entries)
    if not blocks.attention and not blocks.mlp:
        raise PlanError(f"tp={tp} found no attention (q/k/v and output Linears) or MLP (up and "
                        "down Linears) block to split in the model; name its Linears like "
                        "q_proj/k_proj/v_proj/o_proj and up_proj/down_proj, or use shard=")
    modules = dict(model.named_modules())
    layout = Layout(attention=blocks.attention, mlp=blocks.mlp, kept=blocks.kept)
    for path in blocks.attention:
        layout.heads[path] = _head_counts(modules[path], path, tp)
    for path, roles in blocks.mlp.items():
        widths = {modules[_join(path, n)].out_features for n in roles["up"]}
        if widths != {modules[_join(path, roles["down"][0])].in_features}:
            raise PlanError(f"tp={tp}: MLP {path or '<model>'} has up Linears of widths "
                            f"{sorted(widths)} but its down Linear {roles['down'][0]} takes "
                            f"{modules[_join(path, roles['down'][0])].in_features} features: "
                            "not an up/down pair tp can split")
    _find_vocabulary(model, entries, blocks, layout, tp)
    _check_divisible(model, layout, tp)
    return layout


def _find_vocabulary(model: nn.Module, entries: list[ModuleEntry], blocks: TensorParallelBlocks,
                     layout: Layout, tp: int) -> None:
    """The embedding and head ``plan.tensor_parallel_vocabulary`` names, checked on the live
    modules; what cannot be split is kept whole with the reason (never refused: the blocks
    are the larger part and split all the same)."""
    found = tensor_parallel_vocabulary(entries, blocks)
    if found.unpaired is not None:
        layout.vocabulary_kept[found.unpaired] = (
            "no vocabulary-sized head Linear found: its weight may be used directly (a tied "
            "x @ weight.T), which a sharded weight would break")
    modules = dict(model.named_modules())
    embedding = modules[found.embedding] if found.embedding is not None else None
    head = modules[found.head] if found.head is not None else None
    if embedding is not None:
        why = _embedding_problem(embedding, tp)
        if why:
            layout.vocabulary_kept[found.embedding] = why
        else:
            layout.embedding = found.embedding
    if head is not None:
        vocabulary = embedding.num_embeddings
        if head.out_features != vocabulary:
            layout.vocabulary_kept[found.head] = (
                f"{head.out_features} outputs, not the embedding's {vocabulary} tokens")
        elif vocabulary % tp:
            layout.vocabulary_kept[found.head] = f"vocabulary {vocabulary} not divisible by tp"
        else:
            layout.head = found.head
    tied = head is not None and head.weight is embedding.weight
    if tied and (layout.embedding is None) != (layout.head is None):
        # a weight cannot be split for one module and whole for the other
        for path, other in ((layout.embedding, found.head), (layout.head, found.embedding)):
            if path is not None:
                layout.vocabulary_kept[path] = (f"its weight is tied to {other}, which stays "
                                                "replicated")
        layout.embedding = layout.head = None
    layout.tied = tied and layout.head is not None


def _embedding_problem(embedding: nn.Module, tp: int) -> str:
    if not isinstance(embedding, nn.Embedding):
        return f"{type(embedding).__name__} is not torch.nn.Embedding"
    if embedding.num_embeddings % tp:
        return f"{embedding.num_embeddings} tokens, not divisible by tp"
    if embedding.padding_idx is not None or embedding.max_norm is not None or embedding.sparse:
        return ("padding_idx, max_norm or sparse gradients: the local lookup would apply "
                "them to global token ids")
    return ""


def _head_counts(module: nn.Module, path: str, tp: int) -> dict[str, int]:
    counts = {a: getattr(module, a) for a in HEAD_ATTRIBUTES
              if isinstance(getattr(module, a, None), int) and not isinstance(
                  getattr(module, a), bool)}
    if not counts:
        raise PlanError(f"tp={tp}: attention {path or '<model>'} ({type(module).__name__}) has no "
                        f"head-count attribute ({', '.join(HEAD_ATTRIBUTES[:4])}, ...) to divide "
                        "by tp, so its reshape into heads would break on the split q/k/v")
    for name, count in counts.items():
        if count % tp:
            raise PlanError(f"tp={tp}: attention {path or '<model>'} has {name}={count}, not "
                            f"divisible by tp: each rank must hold whole heads")
    return counts


def _check_divisible(model: nn.Module, layout: Layout, tp: int) -> None:
    modules = dict(model.named_modules())
    for path, style in layout.linear_paths().items():
        linear = modules[path]
        width = linear.out_features if style == "colwise" else linear.in_features
        if width % tp:
            side = "output" if style == "colwise" else "input"
            raise PlanError(f"tp={tp}: {path} has {width} {side} features, not divisible by tp")


#: the (data-parallel x tensor-parallel) DeviceMesh ``make_mesh`` made, with what it was
#: made for (shape, device, process group): a later job in the same process (the tests run
#: several scripts on one group) gets a new one when any of these changed
_mesh: tuple | None = None


def make_mesh(plan: Plan, device_type: str):
    """One mesh per process group: ``(dp, tp)``, or ``(dp, pp, tp)`` under a pipeline (as
    torchtitan orders it); consecutive ranks in one tensor-parallel group (they exchange
    activations every layer: the fastest links on a node), then a pipeline's stages."""
    global _mesh
    import torch.distributed as dist
    shape, names = (plan.data_parallel_size, plan.tp), ("dp", "tp")
    if plan.pp > 1:
        shape, names = (plan.data_parallel_size, plan.pp, plan.tp), ("dp", "pp", "tp")
    key = (shape, device_type, id(dist.group.WORLD))
    if _mesh is None or _mesh[0] != key:
        from torch.distributed.device_mesh import init_device_mesh
        _mesh = (key, init_device_mesh(device_type, shape, mesh_dim_names=names))
    return _mesh[1]


def data_parallel_mesh(plan: Plan, device_type: str):
    """The ``dp`` dimension FSDP shards over under ``tp``."""
    return make_mesh(plan, device_type)["dp"]


def data_parallel_rank(plan: Plan, rank: int) -> int:
    """Which slice of the batch ``rank`` takes: the tensor-parallel group's index."""
    return rank // plan.tp


def apply_tensor_parallel(model: nn.Module, plan: Plan, device_type: str) -> Layout | None:
    """Split the model's recognised blocks over the plan's tensor-parallel ranks, in place;
    returns what was split (None without tp)."""
    if plan.tp < 2:
        return None
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module)

    layout = find_layout(model, plan.tp)
    tp_mesh = make_mesh(plan, device_type)["tp"]
    modules = dict(model.named_modules())
    for blocks in (layout.attention, layout.mlp):
        for path, roles in blocks.items():
            # with sp each column-parallel Linear gathers the sequence-split input itself
            # (the block's forward may take more arguments than the hidden states, which
            # a PrepareModuleInput on the block would have to name one by one)
            up = ColwiseParallel(input_layouts=Shard(1)) if plan.sp else ColwiseParallel()
            down = (RowwiseParallel(output_layouts=Shard(1)) if plan.sp
                    else RowwiseParallel())
            styles = {name: up for name in roles["up"]}
            styles.update({name: down for name in roles["down"]})
            parallelize_module(modules[path], tp_mesh, styles)
    for path, counts in layout.heads.items():
        for name, count in counts.items():
            setattr(modules[path], name, count // plan.tp)
    _split_vocabulary(layout, tp_mesh, modules)
    if plan.sp:
        layout.sequence_cut, layout.sequence_whole = _sequence_parallel(layout, tp_mesh,
                                                                        modules)
    _check_split(model, layout, plan)
    return layout


def _split_vocabulary(layout: Layout, tp_mesh, modules: dict) -> None:
    """The embedding's and the head's vocabulary rows over the group; both shard the weight
    along dimension 0, so a tied weight is re-tied to the embedding's DTensor afterwards (as
    PyTorch's TP test ``Transformer.parallelize`` does) and stays one parameter."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module)

    if layout.embedding is not None:
        parallelize_module(modules[layout.embedding], tp_mesh, RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Replicate()))
    if layout.head is not None:
        parallelize_module(modules[layout.head], tp_mesh,
                           ColwiseParallel(output_layouts=Replicate()))
    if layout.tied:
        modules[layout.head].weight = modules[layout.embedding].weight


def _sequence_parallel(layout: Layout, tp_mesh, modules: dict):
    """``sp``: the residual stream inside the blocks holds this rank's part of the
    sequence (dimension 1): the first block's input is cut, the last block's output
    gathered; norms inside the blocks run ``SequenceParallel``; a block left replicated
    (a fused-qkv attention) gets the whole sequence and gives back this rank's part.
    Returns (cut, whole): the two stream functions."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    split = list(layout.attention) + list(layout.mlp)
    stack = list(dict.fromkeys(path.rpartition(".")[0] for path in split))
    if "" in stack:
        raise PlanError("sp: the split attention/MLP blocks sit at the model's top level; sp "
                        "needs them inside repeated blocks (a ModuleList of layers)")
    for parent in stack:
        for name, module in modules[parent].named_modules():
            if type(module).__name__.endswith(NORM_SUFFIXES):
                parallelize_module(module, tp_mesh, SequenceParallel())

    def cut(tensor):
        return DTensor.from_local(tensor, tp_mesh, [Replicate()], run_check=False).redistribute(
            tp_mesh, [Shard(1)]).to_local()

    def whole(tensor):
        if isinstance(tensor, DTensor):
            return tensor.full_tensor()
        return DTensor.from_local(tensor, tp_mesh, [Shard(1)], run_check=False).full_tensor()

    def on_first(function):
        def hook(_module, args, kwargs):
            if args and hasattr(args[0], "dim") and args[0].dim() >= 2:
                args = (function(args[0]), *args[1:])
            return args, kwargs
        return hook

    def on_output(function):
        def hook(_module, _args, output):
            if isinstance(output, tuple):
                return (function(output[0]), *output[1:])
            return function(output)
        return hook

    modules[stack[0]].register_forward_pre_hook(on_first(cut), with_kwargs=True)
    modules[stack[-1]].register_forward_hook(on_output(whole))
    for path in layout.kept:
        modules[path].register_forward_pre_hook(on_first(whole), with_kwargs=True)
        modules[path].register_forward_hook(on_output(cut))
    return cut, whole


def _check_split(model: nn.Module, layout: Layout, plan: Plan) -> None:
    """Every Linear the layout names holds a DTensor shard now (the knob took effect)."""
    modules = dict(model.named_modules())
    for path in layout.split_paths():
        if not hasattr(modules[path].weight, "full_tensor"):
            raise PlanError(f"tp={plan.tp} did not take effect: {path}.weight is not sharded")
    if layout.tied and modules[layout.head].weight is not modules[layout.embedding].weight:
        raise PlanError(f"tp={plan.tp}: {layout.head}.weight is no longer tied to "
                        f"{layout.embedding}.weight")


def describe(layout: Layout | None, sequence_parallel: bool = False) -> str:
    if layout is None:
        return ""
    text = (f"tensor parallel: {len(layout.attention)} attention + {len(layout.mlp)} MLP "
            "blocks split" + (", sequence parallel between them" if sequence_parallel else ""))
    vocabulary = [p for p in (layout.embedding, layout.head) if p is not None]
    if vocabulary:
        text += (f"; {' and '.join(vocabulary)} split along the vocabulary"
                 + (" (tied weight, one shared shard)" if layout.tied else ""))
    if layout.kept:
        first = next(iter(layout.kept))
        text += (f"; {len(layout.kept)} attention kept replicated ({first or '<model>'}: "
                 f"{layout.kept[first]})")
    for path, why in layout.vocabulary_kept.items():
        text += f"; {path} kept replicated ({why})"
    return text


def clip_mixed_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                          error_if_nonfinite: bool = False, foreach=None):
    """``clip_grad_norm_`` over gradients some of which are DTensor shards (the split
    Linears) and some plain tensors (the replicated embedding, norms): torch's foreach
    kernels refuse the mix.  Each DTensor's norm is made whole (a collective over the
    tensor-parallel group), then combined and applied per tensor; same result."""
    import torch
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norm_type = float(norm_type)
    norms = []
    for grad in grads:
        norm = torch.linalg.vector_norm(grad, norm_type)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                           "non-finite, so it cannot be clipped")
    coefficient = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    for grad in grads:
        grad.mul_(coefficient)
    return total


def without_foreach(optimizer) -> None:
    """Step the optimizer tensor by tensor: on CUDA torch.optim picks its ``foreach``
    kernels, which refuse a list mixing DTensor shards with plain tensors (the replicated
    embedding) or DTensors of two meshes (FSDP's 1-D and 2-D) -- ``aten._foreach_mul_
    got mixed torch.Tensor and DTensor``.  Only a default (``None``) is changed."""
    for group in getattr(optimizer, "param_groups", []):
        if "foreach" in group and group["foreach"] is None:
            group["foreach"] = False
