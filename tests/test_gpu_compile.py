"""``torch_kl`` inside ``torch.compile`` (default, ``fullgraph=True``, ``mode="reduce-overhead"``)
and under ``torch.cuda.graph`` capture: the eager result, for every loss of the family and
every teacher format and the fused cross-entropy, with ignored rows and non-contiguous views.
A vocabulary of 8191 leaves the logits GEMM to cuBLAS; the cases of 8192 columns take the
Triton backend's fused logits GEMM (and, for the cross-entropy, its factored ``dL/dz``).

Run on a GPU machine: ``python -m pytest -m gpu tests/test_gpu_compile.py``.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from gpu_runners import rel  # noqa: E402

import torch_kl  # noqa: E402

N, H, V, HT, K = 512, 256, 8191, 128, 32
CASES = {
    "forward-probs": dict(target_format="probs"),
    "reverse-logits": dict(target_format="logits", beta=1.0),
    "jsd-hard-softcap": dict(target_format="log_probs", beta=0.5, weight_hard_loss=0.5, softcap=20.0),
    "hidden": dict(target_format="hidden", temperature=2.0),
    "topk-bin-hard": dict(target_format="topk_log_probs", weight_hard_loss=0.3, label_smoothing=0.1),
    "topk-renormalize": dict(target_format="topk_log_probs", topk_tail="renormalize"),
    "topk-bin-hard-fused-gemm": dict(target_format="topk_log_probs", weight_hard_loss=0.3, vocab=8192),
    "cross-entropy-factored": dict(target_format=None, vocab=8192),
    "cross-entropy-softcap-sum-factored": dict(target_format=None, vocab=8192, softcap=30.0, reduction="sum"),
    "cross-entropy-smoothing": dict(target_format=None, vocab=8192, label_smoothing=0.1),  # not factored
}


def _inputs(fmt: str | None, seed: int = 0, vocab: int = V):
    g = torch.Generator(device="cuda").manual_seed(seed)
    base = torch.randn(N, 2 * H, device="cuda", generator=g, dtype=torch.bfloat16)
    layer = torch.nn.Linear(H, H, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(vocab, H, device="cuda", generator=g) / H**0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, vocab, (N,), device="cuda", generator=g)
    labels[::3] = -100
    extra = {}
    raw = torch.randn(N, vocab, device="cuda", generator=g) * 2
    if fmt == "hidden":
        target = torch.randn(N, HT, device="cuda", generator=g, dtype=torch.bfloat16)
        extra["teacher_weight"] = torch.randn(vocab, HT, device="cuda", generator=g, dtype=torch.bfloat16) / HT**0.5
    elif fmt is None:  # the fused cross-entropy: no teacher
        target = None
    elif fmt == "topk_log_probs":
        target, extra["target_indices"] = raw.log_softmax(-1).topk(K, dim=-1)
    else:
        full = {"probs": raw.softmax(-1), "log_probs": raw.log_softmax(-1), "logits": raw}[fmt]
        target = full.t().contiguous().t()  # a non-contiguous view of the teacher
    return base[:, ::2], layer, w, target, labels, extra  # x: a non-contiguous view


def _step(x, layer, w, target, labels, extra, options):
    h = layer(x)
    options = {k: v for k, v in options.items() if k != "vocab"}
    if options["target_format"] is None:
        options.pop("target_format")
        return torch_kl.fused_linear_cross_entropy(h, w, labels, backend="triton", **options)
    return torch_kl.fused_linear_kl_div(h, w, target, labels, backend="triton", **extra, **options)


def _eager_and(run, case: str):
    options = CASES[case]
    x, layer, w, target, labels, extra = _inputs(options["target_format"], vocab=options.get("vocab", V))
    results = []
    for fn in (_step, run):
        loss = fn(x, layer, w, target, labels, extra, options)
        loss.backward()
        results.append((loss.detach().clone(), w.grad.clone(), layer.weight.grad.clone()))
        w.grad = layer.weight.grad = layer.bias.grad = None
    (l0, gw0, gl0), (l1, gw1, gl1) = results
    assert torch.allclose(l0, l1, rtol=1e-3, atol=1e-4), (l0, l1)
    assert rel(gw1, gw0) < 1e-2 and rel(gl1, gl0) < 1e-2, (rel(gw1, gw0), rel(gl1, gl0))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", ("default", "fullgraph", "reduce-overhead"))
def test_compile(case, mode):
    torch._dynamo.reset()
    kw = {"fullgraph": True} if mode == "fullgraph" else {"mode": "reduce-overhead"} if mode != "default" else {}
    _eager_and(torch.compile(_step, **kw), case)


@pytest.mark.parametrize("case", CASES)
def test_cuda_graph_capture(case):
    """Forward + backward captured once, replayed on new inputs copied into the static ones."""
    options = CASES[case]
    x, layer, w, target, labels, extra = _inputs(options["target_format"], vocab=options.get("vocab", V))
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (compiles the kernels) outside the capture
        _step(static_x, layer, w, target, labels, extra, options).backward()
    torch.cuda.current_stream().wait_stream(s)
    w.grad = layer.weight.grad = layer.bias.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = _step(static_x, layer, w, target, labels, extra, options)
        static_loss.backward()
    x2 = _inputs(options["target_format"], seed=1, vocab=options.get("vocab", V))[0]
    static_x.copy_(x2)
    graph.replay()
    got = (static_loss.clone(), w.grad.clone())
    w.grad = layer.weight.grad = layer.bias.grad = None
    want = _step(x2, layer, w, target, labels, extra, options)
    want.backward()
    assert torch.allclose(got[0], want.detach(), rtol=1e-3, atol=1e-4), (got[0], want)
    assert rel(got[1], w.grad) < 1e-2
