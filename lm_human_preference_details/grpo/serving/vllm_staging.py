"""Weight updates of a vLLM worker's model, loaded outside the pause (`vllm_server.py --weight-staging staged`).

vLLM's layer-wise reload (`vllm.model_executor.model_loader.reload`) loads new weights layer by layer and runs each
layer's `quant_method.process_weights_after_loading`, which on the CPU repacks every linear weight for oneDNN
(`dispatch_cpu_unquantized_gemm`: the packed weight lives in a closure, `layer.cpu_linear`, and the layer's
`weight` is left empty). On the live model that takes seconds, all of them while generation is paused. Here the
reload runs on a shadow of the model instead, while the live model generates, and the pause only swaps:

- `shadow_of(model)`: a copy of the model's module tree whose parameters and buffers are clones (the same Parameter
  classes and attributes, weight loaders bound to the shadow's layers), everything else shared with the live model
  (configs, quant methods, attention backends, the KV cache). Each shadow layer gets its own copy of the live
  layer's reload metadata (the model-format shapes that `record_metadata_for_reloading` kept at startup).
- `prepare(shadow, ...)`: the layer-wise reload, then the embeddings' `process_weights_after_loading` again (a tied
  `lm_head` keeps its old packed copy otherwise), all on the shadow.
- `swap(model, shadow)`: for each parameter and buffer, exchange its `.data` with the shadow's (the live Parameter
  objects stay, so anything holding them sees the new values; the shadow keeps the old storage for the next
  reload to write into); for each attribute that the reload rebound on a shadow layer (`cpu_linear` and its packed
  weight, anything a quant method sets), the live layer takes the shadow's object. Pointer swaps, no copy.

Between updates the shadow's attributes are the live model's objects, so the attributes a reload rebinds are those
no longer the live one's. Memory: the shadow holds a second copy of the weights, packed, for as long as the server
lives; the old packed weights are freed when the next update rebinds them. A tied embedding costs more than its
share: it is packed twice (for the embedding and for the head) in the shadow as in the live model, and cloned too
(the measured cost: benchmarks/README.md, "Weight updates against the transport").
Departure from vLLM: none of its code is changed; the reload runs as vLLM's own, on modules vLLM does not know of.
"""

import copy
import time
from types import MethodType

import torch

_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})
"""the nn.Module fields `shadow_of` gives the shadow its own of; the rest of a layer's fields are shared"""


def shadow_of(model: torch.nn.Module) -> torch.nn.Module:
    """A shadow of `model` for `prepare` (see the module's docstring); run while nothing changes the live model."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, get_layerwise_info
    from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo

    twins: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        twin = copy.copy(module)  # shares every field: the internals are replaced below
        twin._parameters, twin._buffers, twin._modules = {}, {}, {}
        twin._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
        twins[id(module)] = twin
    cloned: dict[int, torch.Tensor] = {}  # a tied parameter is cloned once and stays tied
    for module in model.modules():
        twin = twins[id(module)]
        twin._modules = {name: None if c is None else twins[id(c)] for name, c in module._modules.items()}
        for fields, twin_fields in ((module._parameters, twin._parameters), (module._buffers, twin._buffers)):
            for name, tensor in fields.items():
                if tensor is not None and id(tensor) not in cloned:
                    cloned[id(tensor)] = _clone(tensor, twins)
                twin_fields[name] = None if tensor is None else cloned[id(tensor)]
        live = get_layerwise_info(module)
        params, buffers = live.restore_metadata
        LAYERWISE_INFO[twin] = LayerReloadingInfo(
            restore_metadata=(
                {name: _meta_twin(t, module, twins) for name, t in params.items()},
                {name: _meta_twin(t, module, twins) for name, t in buffers.items()},
            ),
            restore_device=live.restore_device,
        )
    return twins[id(model)]


def prepare(model: torch.nn.Module, shadow: torch.nn.Module, weights, vllm_config) -> float:
    """Load `weights` ((name, tensor) pairs, the trainer's names) into the shadow of `model` and process them for
    vLLM's kernels: the layer-wise reload, as `vllm_server.WeightReceiver` runs it in place. Returns its seconds.
    A failure leaves the shadow half loaded (build another) and the live model untouched."""
    from vllm.config import set_current_vllm_config

    start = time.perf_counter()
    with set_current_vllm_config(vllm_config), torch.no_grad():
        reload_layerwise(shadow, weights, vllm_config.model_config)
    _check_swappable(model, shadow)
    return time.perf_counter() - start


def _check_swappable(model: torch.nn.Module, shadow: torch.nn.Module) -> None:
    """Refuse, before the pause, a reload that left the shadow's layers with other tensors than the live ones'."""
    twins = dict(shadow.named_modules(remove_duplicate=False))
    for name, module in model.named_modules(remove_duplicate=False):
        twin = twins.get(name)
        if (
            twin is None
            or module._parameters.keys() != twin._parameters.keys()
            or (module._buffers.keys() != twin._buffers.keys())
        ):
            raise RuntimeError(f"the reloaded layer {name or 'model'} has other tensors than the serving one")


def reload_layerwise(model: torch.nn.Module, weights, model_config) -> None:
    """vLLM's layer-wise reload of `model`, then each VocabParallelEmbedding's post-processing again (a tied
    lm_head's packed copy is the embedding's, made before the reload); each layer's weight loader takes its
    worker's shard. Under `set_current_vllm_config` and `torch.no_grad()`."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    initialize_layerwise_reload(model)
    model.load_weights(weights)
    finalize_layerwise_reload(model, model_config)
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding):  # ParallelLMHead too
            module.quant_method.process_weights_after_loading(module)


def swap(model: torch.nn.Module, shadow: torch.nn.Module) -> None:
    """Make the prepared shadow's weights the live model's (generation paused): `.data` exchanged for each
    parameter and buffer, and each attribute the reload rebound on the shadow taken by the live layer."""
    twins = dict(shadow.named_modules(remove_duplicate=False))
    swapped: set[int] = set()  # a tied parameter is swapped once (twice would swap it back)
    for name, module in model.named_modules(remove_duplicate=False):
        twin = twins[name]
        for fields, twin_fields in ((module._parameters, twin._parameters), (module._buffers, twin._buffers)):
            for field, tensor in fields.items():
                if tensor is not None and id(tensor) not in swapped:
                    other = twin_fields[field]
                    if tensor.is_cuda:  # a CUDA graph holds the address: one copy on the GPU instead
                        tensor.copy_(other)
                    else:
                        tensor.data, other.data = other.data, tensor.data
                    swapped.add(id(tensor))
        for field, value in twin.__dict__.items():
            if field not in _MODULE_INTERNALS and module.__dict__.get(field, _ABSENT) is not value:
                module.__dict__[field] = value


_ABSENT = object()


def discard(shadow: torch.nn.Module) -> None:
    """Forget a shadow (half loaded, or never swapped in): vLLM's reload metadata of its layers refers to them, and
    would keep their tensors alive."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    for module in shadow.modules():
        LAYERWISE_INFO.pop(module, None)


def _for_twins(value, twins: dict[int, torch.nn.Module]):
    """`value`, a tensor's attribute, with a method bound to a live layer bound to that layer's twin instead."""
    if isinstance(value, MethodType) and id(value.__self__) in twins:
        return value.__func__.__get__(twins[id(value.__self__)])
    return value


def _clone(tensor: torch.Tensor, twins: dict[int, torch.nn.Module]) -> torch.Tensor:
    """A copy of a live parameter or buffer: its values in new storage, its class and attributes (vLLM's
    Parameter subclasses keep their weight loader and shard dimensions there)."""
    twin = tensor.detach().clone()
    twin.__class__ = tensor.__class__
    twin.__dict__ = {k: _for_twins(v, twins) for k, v in tensor.__dict__.items()}
    return twin


def _meta_twin(tensor: torch.Tensor, module: torch.nn.Module, twins: dict[int, torch.nn.Module]) -> torch.Tensor:
    """A copy of one tensor of a live layer's reload metadata (a meta tensor) for the layer's twin: a method bound
    to the layer is bound to vLLM's placeholder, as in the metadata it records (the reload binds it to the layer
    it restores)."""
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    twin = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device="meta")
    twin.__class__ = tensor.__class__
    twin.__dict__ = {
        k: v.__func__.__get__(layer_ref_sentinel)
        if isinstance(v, MethodType) and v.__self__ is module
        else _for_twins(v, twins)
        for k, v in tensor.__dict__.items()
    }
    return twin
