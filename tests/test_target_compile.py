"""The target's decoder layers under torch.compile: the same features as eager, one graph per layer type, any shape."""

from __future__ import annotations

import inspect

import pytest
import torch

from dflash.data.synthetic import hybrid_target_config, target_config, write_target
from dflash.models.target import compile_target, load_target, target_features


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{kind: folder} of a tiny random dense (Qwen3) and hybrid (Qwen3.5: Gated DeltaNet + full attention) target."""
    root = tmp_path_factory.mktemp("targets")
    fields = {"num_hidden_layers": 4, "vocab_size": 256, "initializer_range": 0.1}  # the hybrid: 3 linear + 1 full
    return {"dense": write_target(root / "dense", target_config(**fields)),
            "hybrid": write_target(root / "hybrid", hybrid_target_config(**fields))}


class GraphCounter:
    """A torch.compile backend running dynamo's graphs as traced (no inductor: CPU compilation would take minutes)
    and counting them."""

    def __init__(self):
        self.graphs = 0
        self.ops: set[str] = set()  # the custom ops the graphs call (dflash::delta_rule_N for a hybrid's delta rule)

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        self.ops |= {str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "dflash" in str(n.target)}
        return gm.forward


def _features(model, ids, layer_ids, want_last):
    return target_features(model, ids, None, layer_ids, want_last)


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_compiled_layers_give_the_eager_features_for_every_shape(folders, kind):
    torch._dynamo.reset()
    eager = load_target(folders[kind], "float32", "cpu")
    compiled = compile_target(load_target(folders[kind], "float32", "cpu"), backend=(counter := GraphCounter()))
    g = torch.Generator().manual_seed(0)
    # Bucket shapes differ from batch to batch; a batch of one row is a graph of its own (dynamo specialises size 1):
    # the dense target shows it, the hybrid (whose Gated DeltaNet graph takes ~15 s to trace here) does not repeat it.
    # The hybrid's lengths span one and three of the delta rule's 64-token chunks.
    shapes = [(2, 24), (3, 40), (1, 33)] if kind == "dense" else [(2, 24), (3, 150)]
    for B, S in shapes:
        ids = torch.randint(0, 256, (B, S), generator=g)
        for layer_ids, want_last in (([0, 2], False), ([1, 3], True)):
            ctx, last = _features(compiled, ids, layer_ids, want_last)
            ref_ctx, ref_last = _features(eager, ids, layer_ids, want_last)
            assert torch.allclose(ctx, ref_ctx, atol=1e-4, rtol=1e-4), (B, S, (ctx - ref_ctx).abs().max().item())
            if want_last:
                assert torch.allclose(last, ref_last, atol=1e-4, rtol=1e-4), (B, S, (last - ref_last).abs().max().item())
    # One graph per layer type for every batch of two rows or more, one more per type for a batch of one; the
    # hybrid's delta rule is an opaque op inside its graph, not a graph break.
    assert counter.graphs == (2 if kind == "hybrid" else 2 * 1), counter.graphs
    # The delta rule runs as the opaque op inside the graph (the decoder's keywords, use_cache=False among them, do
    # not send it back to the kernel, whose chunk loop dynamo would unroll per length).
    assert bool(counter.ops) == (kind == "hybrid"), counter.ops


def test_the_delta_rule_op_matches_its_kernel_and_its_fake_the_real_strides(folders):
    """torch.library.opcheck on the op with the inputs a Qwen3.5 layer gives it (a value that is a non-contiguous
    view): the fake implementation's shape, dtype and strides are the real output's (inductor asserts them)."""
    from dflash.models.target import _DELTA_RULE_OPS, DELTA_RULES, linear_attention_kernels

    load_target(folders["hybrid"], "float32", "cpu")  # binds the PyTorch delta rule on CPU
    model = compile_target(load_target(folders["hybrid"], "float32", "cpu"), backend="eager")
    layer = next(m for m in model.modules() if linear_attention_kernels(m))
    delta_rule = linear_attention_kernels(layer)[DELTA_RULES[0]]
    g = torch.Generator().manual_seed(5)
    B, S, H, D = 2, 70, 4, 16
    qkv = torch.randn(B, 3 * H * D, S, generator=g).transpose(1, 2)  # the conv output, transposed back: a view
    q, k, _ = (t.reshape(B, S, H, D) for t in torch.split(qkv, [H * D] * 3, dim=-1))
    v = torch.randn(B, H * D, S, generator=g).transpose(1, 2).reshape(B, S, H, D)  # dense, in another dim order
    assert not v.is_contiguous() and v.stride()[1] == 1
    gate, beta = -torch.rand(B, S, H, generator=g), torch.rand(B, S, H, generator=g)
    out, state = delta_rule(q, k, v, g=gate, beta=beta, initial_state=None, output_final_state=False,
                            use_qk_l2norm_in_kernel=True, use_cache=False)
    assert state is None and out.shape == (B, S, H, D) and out.is_contiguous()
    op = inspect.getclosurevars(delta_rule).nonlocals["op"]
    assert op in _DELTA_RULE_OPS
    torch.library.opcheck(op, (q, k, v, gate, beta, True), test_utils=("test_schema", "test_faketensor"))
    from torch._subclasses.fake_tensor import FakeTensorMode  # opcheck compares shapes and dtypes, not strides

    real = op(q, k, v, gate, beta, True)
    with FakeTensorMode() as mode:
        fake = op(*(mode.from_tensor(t) for t in (q, k, v, gate, beta)), True)
    assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_shifted_causal_conv_is_transformers_conv(dtype):
    """causal_conv1d_shifts (what a compiled hybrid layer calls) gives transformers' reference causal_conv1d_fn:
    with and without bias and activation, lengths shorter and longer than the kernel."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from dflash.models.target import _implementation, causal_conv1d_shifts

    reference = inspect.unwrap(_implementation(modeling_qwen3_5.causal_conv1d_fn))
    assert reference.__module__.startswith("transformers.")
    g = torch.Generator().manual_seed(3)
    for S, bias, activation in ((1, True, "silu"), (3, False, None), (37, True, None), (64, False, "silu")):
        x = torch.randn(2, 12, S, generator=g).to(dtype)
        w = torch.randn(12, 4, generator=g).to(dtype)
        b = torch.randn(12, generator=g).to(dtype) if bias else None
        got, want = causal_conv1d_shifts(x, w, b, activation=activation), reference(x, w, b, activation=activation)
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the reference rounds its product sums, these do not
        assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), (S, (got - want).abs().max().item())


def test_in_bf16_the_compiled_hybrid_is_as_close_to_float32_as_eager(folders):
    """The compiled layer's conv sums in float32 where transformers' bf16 conv rounds: against the float32 forward of
    the same weights, its features are no further off than eager bf16's (it is not a bf16 accuracy loss)."""
    torch._dynamo.reset()
    ids = torch.randint(0, 256, (2, 150), generator=torch.Generator().manual_seed(6))
    reference = _features(load_target(folders["hybrid"], "float32", "cpu"), ids, [0, 2, 3], True)
    eager = _features(load_target(folders["hybrid"], "bfloat16", "cpu"), ids, [0, 2, 3], True)
    compiled = _features(compile_target(load_target(folders["hybrid"], "bfloat16", "cpu"), backend="eager"), ids,
                         [0, 2, 3], True)

    def error(got):
        return max(((g.float() - r).norm() / r.norm()).item() for g, r in zip(got, reference))

    assert error(compiled) <= 1.25 * error(eager), (error(compiled), error(eager))  # 0.072 vs 0.070 here


def test_a_compiled_hybrid_layer_runs_no_convolution(folders):
    """The compiled linear-attention layer's graph holds no convolution op (the conv is the shifted multiply-adds)."""
    torch._dynamo.reset()
    targets: set[str] = set()

    def backend(gm, example_inputs):
        targets.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    model = compile_target(load_target(folders["hybrid"], "bfloat16", "cpu"), backend=backend)
    _features(model, torch.randint(0, 256, (2, 20)), [0, 1], False)
    assert targets and not [t for t in targets if "conv" in t.lower()], sorted(targets)
    # Called eagerly (a layer whose compilation failed), the layer's conv is transformers' own, bit for bit.
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from dflash.models.target import _implementation, linear_attention_kernels

    conv = next(k["causal_conv1d_fn"] for m in model.modules() if (k := linear_attention_kernels(m)))
    x, w = torch.randn(2, 8, 30).bfloat16(), torch.randn(8, 4).bfloat16()
    reference = inspect.unwrap(_implementation(modeling_qwen3_5.causal_conv1d_fn))
    assert torch.equal(conv(x, w, None, activation="silu"), reference(x, w, None, activation="silu"))


def test_a_hybrids_layer_types_compile_as_functions_of_their_own(folders):
    """torch.compile keeps graphs and counts recompiles per code object: the hybrid's linear-attention and full-attention
    layers get one each (sharing their class's would guard on which submodule a layer holds); a dense model's one."""
    hybrid = compile_target(load_target(folders["hybrid"], "float32", "cpu"), backend="eager")
    codes = {layer.forward.__wrapped__.__code__.co_name for layer in hybrid.model.layers}
    assert codes == {"forward_input_layernorm_linear_attn_mlp_post_attention_layernorm",
                     "forward_input_layernorm_mlp_post_attention_layernorm_self_attn"}, codes
    dense = compile_target(load_target(folders["dense"], "float32", "cpu"), backend="eager")
    assert {layer.forward.__wrapped__.__code__.co_name for layer in dense.model.layers} == {"forward"}


def test_compiling_twice_keeps_one_wrapper(folders):
    model = compile_target(load_target(folders["dense"], "float32", "cpu"), backend="eager")
    forwards = [layer.forward.__func__ for layer in model.model.layers]
    compile_target(model, backend="eager")
    assert [layer.forward.__func__ for layer in model.model.layers] == forwards


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (inductor's Triton kernels, fla's delta rule)")
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_compiled_target_on_cuda_matches_eager(folders, kind):
    """bf16 on the GPU, with the profile's kernels (fla's delta rule where installed): against the float32 forward of
    the same weights, the compiled features are no further off than eager bf16's, for three bucket shapes, and no
    graph is built beyond the first batch's. (Two valid bf16 roundings drift apart through the layers: compiled
    against eager alone read 3.4e-2 for the hybrid on an H200, 2026-12-01, while both sit near float32.)"""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    reference = load_target(folders[kind], "float32", "cuda")
    eager = load_target(folders[kind], "bfloat16", "cuda")
    compiled = compile_target(load_target(folders[kind], "bfloat16", "cuda"))
    g = torch.Generator().manual_seed(2)
    graphs = []

    def error(got, ref):
        return ((got.float() - ref.float()).norm() / ref.float().norm()).item()

    for B, S in ((4, 256), (2, 384), (3, 200)):
        ids = torch.randint(0, 256, (B, S), generator=g).cuda()
        ctx, last = _features(compiled, ids, [0, 1, 3], True)
        ref_ctx, ref_last = _features(reference, ids, [0, 1, 3], True)
        eager_ctx, eager_last = _features(eager, ids, [0, 1, 3], True)
        for name, got, base, ref in (("context", ctx, eager_ctx, ref_ctx), ("last", last, eager_last, ref_last)):
            err, err_eager = error(got, ref), error(base, ref)
            print(f"{kind} {B}x{S} {name}: from float32 compiled {err:.2e}, eager {err_eager:.2e}; "
                  f"compiled vs eager {error(got, base):.2e}")
            assert err <= 1.25 * err_eager + 1e-3, f"{kind} {B}x{S} {name}: compiled {err:.2e} from float32, eager " \
                                                   f"bf16 {err_eager:.2e}"
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[-1], f"{kind}: recompiled for a new bucket shape: graphs after each batch {graphs}"


def test_the_hub_kernel_path_compiles_and_matches(folders):
    """The layout a CUDA target has (transformers' hub-kernel wrappers bound in the linear-attention forward, not
    dflash's PyTorch rebinding): its globals are guarded through their own module, features equal eager."""
    import inspect
    from types import MethodType

    from transformers import AutoModelForCausalLM

    from dflash.models.target import DELTA_RULES, _rebuilt, linear_attention_kernels

    torch._dynamo.reset()
    model = AutoModelForCausalLM.from_pretrained(folders["hybrid"], dtype=torch.float32).eval()
    for module in model.modules():
        if kernels := linear_attention_kernels(module):  # the delta rule's reference (fla needs a GPU), wrappers else
            refs = {name: inspect.unwrap(fn) for name, fn in kernels.items() if name in DELTA_RULES}
            module.forward = MethodType(_rebuilt(type(module).forward, refs), module)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(3))
    ref_ctx, ref_last = _features(model, ids, [1, 3], True)
    ctx, last = _features(compile_target(model, backend=GraphCounter()), ids, [1, 3], True)
    assert torch.allclose(ctx, ref_ctx, atol=1e-4) and torch.allclose(last, ref_last, atol=1e-4)
    from dflash.models.target import causal_conv1d_shifts  # the wrapper's transformers fallback, made traceable

    convs = {linear_attention_kernels(m).get("causal_conv1d_fn") for m in model.modules()} - {None}
    assert convs and all(getattr(c, "__wrapped__", None) is causal_conv1d_shifts for c in convs)


def test_a_compiler_failure_falls_back_to_eager_with_one_warning(folders):
    def broken(gm, example_inputs):
        raise RuntimeError("a backend that cannot compile")

    torch._dynamo.reset()
    eager = load_target(folders["dense"], "float32", "cpu")
    model = compile_target(load_target(folders["dense"], "float32", "cpu"), backend=broken)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    with pytest.warns(UserWarning, match="torch.compile failed on Qwen3DecoderLayer") as caught:
        ctx, _ = _features(model, ids, [1, 3], False)
    assert len([w for w in caught if "torch.compile failed" in str(w.message)]) == 1
    assert torch.equal(ctx, _features(eager, ids, [1, 3], False)[0])
