"""LSTM layers as one ONNX `Scan` each, forward and backward, instead of unrolled steps.

torch's decomposition of `aten.lstm` unrolls the recurrence: every time step of every layer
becomes a dozen forward nodes and twice as many backward ones, each traced on fake tensors,
partitioned and translated one by one. A 2-layer LSTM language model over 35 tokens traced to
thousands of nodes and took 17 s to build cold (a loaded machine: several times that). Here a
layer's recurrence is one operator of ours (`lstm_scan`) with its own backward operator
(`lstm_scan_backward`): the trace records two nodes per layer whatever the length, and each
lowers to one `Scan` whose body is one step. What is not recurrent stays ordinary ATen: the
input projection of all steps at once (one matmul), the weight gradients (one matmul each),
the stacking of final states, dropout and direction handling (torch's own `_rnn_helper`).

The step is torch's (`lstm_cell`): gates = x W_ih^T + b_ih + h W_hh^T + b_hh, split into
input, forget, cell and output gates (that order); c' = f c + i g, h' = o tanh(c'). The
operators' eager kernels compute the same steps in torch, so a graph can be checked against
them (tests) and a trace's first run can run them.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ort_autopatch.engine.backends.ort import OPERATOR_NAMESPACE as NAMESPACE


@torch.library.custom_op(f"{NAMESPACE}::lstm_scan", mutates_args=())
def lstm_scan(
    xp: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, w_hh: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One LSTM layer over `xp` (T, B, 4H: the input projection with both biases): every
    step's hidden state (T, B, H), cell state (T, B, H) and activated gates (T, B, 4H)."""
    h, c = h0, c0
    hs, cs, gs = [], [], []
    for x_t in xp.unbind(0):
        gates = x_t + h @ w_hh.t()
        i, f, g, o = gates.chunk(4, 1)
        i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
        c = f * c + i * g
        h = o * c.tanh()
        hs.append(h)
        cs.append(c)
        gs.append(torch.cat([i, f, g, o], 1))
    return _stacked(hs, h0, xp), _stacked(cs, c0, xp), _stacked(gs, xp[0] if len(xp) else xp, xp)


def _stacked(steps: list[torch.Tensor], like: torch.Tensor, xp: torch.Tensor) -> torch.Tensor:
    if steps:
        return torch.stack(steps)
    return like.new_empty((0, *like.shape[-2:]) if like.dim() >= 2 else (0,))


@lstm_scan.register_fake
def _(xp: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, w_hh: torch.Tensor) -> Any:
    steps, batch, hidden = xp.shape[0], h0.shape[0], h0.shape[1]
    return (
        xp.new_empty((steps, batch, hidden)),
        xp.new_empty((steps, batch, hidden)),
        xp.new_empty((steps, batch, 4 * hidden)),
    )


@torch.library.custom_op(f"{NAMESPACE}::lstm_scan_backward", mutates_args=())
def lstm_scan_backward(
    d_y: torch.Tensor,
    d_c: torch.Tensor,
    gates: torch.Tensor,
    c: torch.Tensor,
    c_prev: torch.Tensor,
    dh_last: torch.Tensor,
    dc_last: torch.Tensor,
    w_hh: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `lstm_scan`'s pre-activation gates (T, B, 4H) and of its initial
    hidden and cell states, from the gradients of its hidden and cell states (`d_y`, `d_c`),
    run from the last step back (`dh_last`, `dc_last`: what flows in after the last)."""
    dh_next, dc_next = dh_last, dc_last
    out = []
    for t in range(d_y.shape[0] - 1, -1, -1):
        i, f, g, o = gates[t].chunk(4, 1)
        dh = d_y[t] + dh_next
        tc = c[t].tanh()
        do = dh * tc
        dc = dc_next + d_c[t] + dh * o * (1 - tc * tc)
        di, dg, df = dc * g, dc * i, dc * c_prev[t]
        dc_next = dc * f
        d_gates = torch.cat(
            [di * i * (1 - i), df * f * (1 - f), dg * (1 - g * g), do * o * (1 - o)], 1
        )
        dh_next = d_gates @ w_hh
        out.append(d_gates)
    out.reverse()
    stacked = torch.stack(out) if out else gates.new_empty(gates.shape)
    return stacked, dh_next, dc_next


@lstm_scan_backward.register_fake
def _(d_y: Any, d_c: Any, gates: Any, c: Any, c_prev: Any, dh: Any, dc: Any, w: Any) -> Any:
    return gates.new_empty(gates.shape), dh.new_empty(dh.shape), dc.new_empty(dc.shape)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
    _, h0, c0, w_hh = inputs
    y, c, gates = output
    ctx.save_for_backward(h0, c0, w_hh, y, c, gates)
    ctx.mark_non_differentiable(gates)


def _backward(ctx: Any, d_y: Any, d_c: Any, _d_gates: Any) -> Any:
    h0, c0, w_hh, y, c, gates = ctx.saved_tensors
    d_y = torch.zeros_like(y) if d_y is None else d_y
    d_c = torch.zeros_like(c) if d_c is None else d_c
    c_prev = torch.cat([c0.unsqueeze(0), c[:-1]], 0)
    h_prev = torch.cat([h0.unsqueeze(0), y[:-1]], 0)
    d_xp, d_h0, d_c0 = lstm_scan_backward(
        d_y, d_c, gates, c, c_prev, torch.zeros_like(h0), torch.zeros_like(c0), w_hh
    )
    four_h, hidden = w_hh.shape
    d_w = d_xp.reshape(-1, four_h).t() @ h_prev.reshape(-1, hidden)
    return d_xp, d_h0, d_c0, d_w


lstm_scan.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op(f"{NAMESPACE}::gru_scan", mutates_args=())
def gru_scan(
    xp: torch.Tensor, h0: torch.Tensor, w_hh: torch.Tensor, b_hh: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One GRU layer over `xp` (T, B, 3H: the input projection with its bias): every step's
    hidden state (T, B, H) and what its gradient needs (T, B, 4H: the reset, update and new
    gates, and the hidden projection of the new gate)."""
    h = h0
    hs, saved = [], []
    for x_t in xp.unbind(0):
        xr, xz, xn = x_t.chunk(3, 1)
        hr, hz, hn = torch.addmm(b_hh, h, w_hh.t()).chunk(3, 1)
        r = (xr + hr).sigmoid()
        z = (xz + hz).sigmoid()
        n = (xn + r * hn).tanh()
        h = (h - n) * z + n
        hs.append(h)
        saved.append(torch.cat([r, z, n, hn], 1))
    steps, batch, hidden = xp.shape[0], h0.shape[0], h0.shape[1]
    if not hs:
        return xp.new_empty((0, batch, hidden)), xp.new_empty((0, batch, 4 * hidden))
    del steps
    return torch.stack(hs), torch.stack(saved)


@gru_scan.register_fake
def _(xp: torch.Tensor, h0: torch.Tensor, w_hh: torch.Tensor, b_hh: torch.Tensor) -> Any:
    steps, batch, hidden = xp.shape[0], h0.shape[0], h0.shape[1]
    return xp.new_empty((steps, batch, hidden)), xp.new_empty((steps, batch, 4 * hidden))


@torch.library.custom_op(f"{NAMESPACE}::gru_scan_backward", mutates_args=())
def gru_scan_backward(
    d_y: torch.Tensor,
    saved: torch.Tensor,
    h_prev: torch.Tensor,
    dh_last: torch.Tensor,
    w_hh: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `gru_scan`'s input projection (T, B, 3H), of its hidden projection
    (T, B, 3H) and of its initial hidden state, from the last step back."""
    dh_next = dh_last
    d_xs, d_hs = [], []
    for t in range(d_y.shape[0] - 1, -1, -1):
        r, z, n, hn = saved[t].chunk(4, 1)
        dh = d_y[t] + dh_next
        dz = dh * (h_prev[t] - n)
        dn = dh * (1 - z) * (1 - n * n)
        dr = dn * hn * r * (1 - r)
        dz = dz * z * (1 - z)
        d_h = torch.cat([dr, dz, dn * r], 1)
        d_xs.append(torch.cat([dr, dz, dn], 1))
        d_hs.append(d_h)
        dh_next = dh * z + d_h @ w_hh
    d_xs.reverse()
    d_hs.reverse()
    if not d_xs:
        empty = saved.new_empty((0, *saved.shape[1:-1], saved.shape[-1] // 4 * 3))
        return empty, empty.clone(), dh_next
    return torch.stack(d_xs), torch.stack(d_hs), dh_next


@gru_scan_backward.register_fake
def _(d_y: Any, saved: Any, h_prev: Any, dh: Any, w: Any) -> Any:
    steps, batch, hidden = d_y.shape[0], d_y.shape[1], d_y.shape[2]
    return (
        d_y.new_empty((steps, batch, 3 * hidden)),
        d_y.new_empty((steps, batch, 3 * hidden)),
        dh.new_empty(dh.shape),
    )


def _gru_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
    _, h0, w_hh, _ = inputs
    y, saved = output
    ctx.save_for_backward(h0, w_hh, y, saved)
    ctx.mark_non_differentiable(saved)


def _gru_backward(ctx: Any, d_y: Any, _d_saved: Any) -> Any:
    h0, w_hh, y, saved = ctx.saved_tensors
    d_y = torch.zeros_like(y) if d_y is None else d_y
    h_prev = torch.cat([h0.unsqueeze(0), y[:-1]], 0)
    d_xp, d_gh, d_h0 = gru_scan_backward(d_y, saved, h_prev, torch.zeros_like(h0), w_hh)
    three_h, hidden = w_hh.shape
    flat = d_gh.reshape(-1, three_h)
    d_w = flat.t() @ h_prev.reshape(-1, hidden)
    return d_xp, d_h0, d_w, flat.sum(0)


gru_scan.register_autograd(_gru_backward, setup_context=_gru_setup)


def gru_scan_layer(
    inp: torch.Tensor,
    hidden: torch.Tensor,
    params: list[torch.Tensor],
    has_biases: bool,
    reverse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's `one_layer_rnn` with `gru_cell` (same arguments and results) through
    `gru_scan`."""
    w_ih, w_hh = params[0], params[1]
    xp = F.linear(inp, w_ih, params[2] if has_biases else None)
    if reverse:
        xp = xp.flip(0)
    b_hh = params[3] if has_biases else w_hh.new_zeros(w_hh.shape[0])
    y, _ = gru_scan(xp, hidden, w_hh, b_hh)
    last = y[-1]
    return (y.flip(0) if reverse else y), last


def _layer(layer_fn: Any, inp: torch.Tensor) -> Any:
    """Our scan for torch's generic GRU layer, else `layer_fn` itself."""
    import functools

    from torch._decomp import decompositions

    if (
        isinstance(layer_fn, functools.partial)
        and layer_fn.func is decompositions.one_layer_rnn
        and layer_fn.keywords.get("hidden_fn") is decompositions.gru_cell
        and not layer_fn.args
        and inp.dim() == 3
    ):
        return gru_scan_layer
    return layer_fn


def scan_layer(
    inp: torch.Tensor,
    hidden: tuple[torch.Tensor, torch.Tensor],
    params: list[torch.Tensor],
    has_biases: bool,
    reverse: bool = False,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """torch's `one_layer_lstm` (same arguments and results) through `lstm_scan`."""
    w_ih, w_hh = params[0], params[1]
    xp = F.linear(inp, w_ih, params[2] if has_biases else None)
    if has_biases:
        xp = xp + params[3]
    if reverse:
        xp = xp.flip(0)
    y, c, _ = lstm_scan(xp, hidden[0], hidden[1], w_hh)
    last = (y[-1], c[-1])
    return (y.flip(0) if reverse else y), last


def _select(input: Any, hx: Any, params: Any) -> Any:
    """Our layer, where torch's would take the generic steps (no projections, no oneDNN)."""
    chosen = _torch_select(input, hx, params)
    from torch._decomp import decompositions

    projected = hx[0].size(-1) != hx[1].size(-1)
    if chosen is decompositions.one_layer_lstm and not projected and input.dim() == 3:
        return scan_layer
    return chosen


def _torch_select(input: Any, hx: Any, params: Any) -> Any:
    from torch._decomp import decompositions

    return _ORIGINAL_SELECT.get("select", decompositions.select_one_layer_lstm_function)(
        input, hx, params
    )


_ORIGINAL_SELECT: dict[str, Any] = {}


def _rnn_helper(
    input: Any,
    hidden: Any,
    params: Any,
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    batch_first: bool,
    layer_fn: Any,
) -> Any:
    """torch's `_rnn_helper` (torch 2.13), with the dropout between layers that eager
    applies: torch's reads `dropout if (train and num_layers < i - 1) else 0.0`, never true,
    so a traced LSTM, GRU or RNN of `dropout > 0` trained without it."""
    from torch._decomp.decompositions import params_hiddens

    input = input.transpose(0, 1) if batch_first else input
    layer_fn = _layer(layer_fn, input)
    final_hiddens = []
    for i in range(num_layers):
        cur_params, cur_hidden, bidir_params, bidir_hidden = params_hiddens(
            params, hidden, i, bidirectional
        )
        fwd_inp, fwd_hidden = layer_fn(input, cur_hidden, cur_params, has_biases)
        final_hiddens.append(fwd_hidden)
        if bidirectional:
            bwd_inp, bwd_hidden = layer_fn(
                input, bidir_hidden, bidir_params, has_biases, reverse=True
            )
            final_hiddens.append(bwd_hidden)
            input = torch.cat([fwd_inp, bwd_inp], fwd_inp.dim() - 1)
        else:
            input = fwd_inp
        if dropout != 0 and train and i < num_layers - 1:
            input = torch.dropout(input, dropout, train=True)
    input = input.transpose(0, 1) if batch_first else input
    return input, final_hiddens


@contextlib.contextmanager
def scanned_lstms() -> Iterator[None]:
    """While it lasts (a trace, under the export lock), torch's LSTM decomposition runs each
    layer through `lstm_scan`, and its recurrent decompositions apply dropout between layers
    as eager does."""
    from torch._decomp import decompositions

    original = decompositions.select_one_layer_lstm_function
    helper = decompositions._rnn_helper
    _ORIGINAL_SELECT["select"] = original
    decompositions.select_one_layer_lstm_function = _select
    decompositions._rnn_helper = _rnn_helper
    try:
        yield
    finally:
        decompositions.select_one_layer_lstm_function = original
        decompositions._rnn_helper = helper


# --- lowering to ONNX ---------------------------------------------------------------------------
_names = itertools.count()


def _body(kind: str, elem: int) -> Any:
    """The Scan body of one step of `kind` (lstm_forward, lstm_backward, gru_forward,
    gru_backward) for ONNX element type `elem`, as onnx_ir's graph."""
    import onnx_ir as ir
    from onnx import helper as h

    def value(name: str, rank: int) -> Any:
        return h.make_tensor_value_info(name, elem, [None] * rank)

    one = h.make_node("Constant", [], ["one"], value=h.make_tensor("one_v", elem, [], [1.0]))
    if kind == "lstm_forward":
        nodes = [
            h.make_node("Gemm", ["h", "w", "x"], ["gates"], transB=1),
            h.make_node("Split", ["gates"], ["gi", "gf", "gg", "go"], axis=1, num_outputs=4),
            h.make_node("Sigmoid", ["gi"], ["i"]),
            h.make_node("Sigmoid", ["gf"], ["f"]),
            h.make_node("Tanh", ["gg"], ["g"]),
            h.make_node("Sigmoid", ["go"], ["o"]),
            h.make_node("Mul", ["f", "c"], ["fc"]),
            h.make_node("Mul", ["i", "g"], ["ig"]),
            h.make_node("Add", ["fc", "ig"], ["c2"]),
            h.make_node("Tanh", ["c2"], ["tc"]),
            h.make_node("Mul", ["o", "tc"], ["h2"]),
            h.make_node("Identity", ["w"], ["w2"]),
            h.make_node("Identity", ["h2"], ["y"]),
            h.make_node("Identity", ["c2"], ["cy"]),
            h.make_node("Concat", ["i", "f", "g", "o"], ["act"], axis=1),
        ]
        inputs = [value("h", 2), value("c", 2), value("w", 2), value("x", 2)]
        outputs = ["h2", "c2", "w2", "y", "cy", "act"]
    elif kind == "lstm_backward":
        nodes = [
            one,
            h.make_node("Add", ["dy", "dh"], ["dhs"]),
            h.make_node("Split", ["act"], ["i", "f", "g", "o"], axis=1, num_outputs=4),
            h.make_node("Tanh", ["ct"], ["tc"]),
            h.make_node("Mul", ["dhs", "tc"], ["do"]),
            h.make_node("Mul", ["tc", "tc"], ["tc2"]),
            h.make_node("Sub", ["one", "tc2"], ["dtanh"]),
            h.make_node("Mul", ["dhs", "o"], ["dho"]),
            h.make_node("Mul", ["dho", "dtanh"], ["dcc"]),
            h.make_node("Add", ["dc", "dct"], ["dc1"]),
            h.make_node("Add", ["dc1", "dcc"], ["dcs"]),
            h.make_node("Mul", ["dcs", "g"], ["di"]),
            h.make_node("Mul", ["dcs", "i"], ["dg"]),
            h.make_node("Mul", ["dcs", "cp"], ["df"]),
            h.make_node("Mul", ["dcs", "f"], ["dc_prev"]),
        ]
        # d(sigmoid) = s (1 - s), d(tanh) = 1 - t^2
        for gate, grad in (("i", "di"), ("f", "df"), ("o", "do")):
            nodes += [
                h.make_node("Sub", ["one", gate], [f"{gate}_c"]),
                h.make_node("Mul", [gate, f"{gate}_c"], [f"{gate}_s"]),
                h.make_node("Mul", [grad, f"{gate}_s"], [f"{gate}_p"]),
            ]
        nodes += [
            h.make_node("Mul", ["g", "g"], ["g2"]),
            h.make_node("Sub", ["one", "g2"], ["g_s"]),
            h.make_node("Mul", ["dg", "g_s"], ["g_p"]),
            h.make_node("Concat", ["i_p", "f_p", "g_p", "o_p"], ["dgates"], axis=1),
            h.make_node("MatMul", ["dgates", "w"], ["dh_prev"]),
            h.make_node("Identity", ["w"], ["w2"]),
        ]
        inputs = [
            value("dh", 2),
            value("dc", 2),
            value("w", 2),
            value("dy", 2),
            value("dct", 2),
            value("act", 2),
            value("ct", 2),
            value("cp", 2),
        ]
        outputs = ["dh_prev", "dc_prev", "w2", "dgates"]
    else:
        nodes, inputs, outputs = _gru_body(kind, value, one)
    ranks = {"b2": 1}
    graph = h.make_graph(
        nodes, f"{kind}_step", inputs, [value(n, ranks.get(n, 2)) for n in outputs]
    )
    return ir.serde.deserialize_graph(graph)


def _gru_body(kind: str, value: Any, one: Any) -> tuple[list[Any], list[Any], list[str]]:
    """A GRU step's body (`gru_scan`, `gru_scan_backward`): nodes, inputs, output names."""
    from onnx import helper as h

    if kind == "gru_forward":
        nodes = [
            h.make_node("Gemm", ["h", "w", "b"], ["gh"], transB=1),
            h.make_node("Split", ["x"], ["xr", "xz", "xn"], axis=1, num_outputs=3),
            h.make_node("Split", ["gh"], ["hr", "hz", "hn"], axis=1, num_outputs=3),
            h.make_node("Add", ["xr", "hr"], ["pr"]),
            h.make_node("Sigmoid", ["pr"], ["r"]),
            h.make_node("Add", ["xz", "hz"], ["pz"]),
            h.make_node("Sigmoid", ["pz"], ["z"]),
            h.make_node("Mul", ["r", "hn"], ["rhn"]),
            h.make_node("Add", ["xn", "rhn"], ["pn"]),
            h.make_node("Tanh", ["pn"], ["n"]),
            h.make_node("Sub", ["h", "n"], ["hmn"]),
            h.make_node("Mul", ["hmn", "z"], ["hz2"]),
            h.make_node("Add", ["hz2", "n"], ["h2"]),
            h.make_node("Identity", ["w"], ["w2"]),
            h.make_node("Identity", ["b"], ["b2"]),
            h.make_node("Identity", ["h2"], ["y"]),
            h.make_node("Concat", ["r", "z", "n", "hn"], ["saved"], axis=1),
        ]
        inputs = [value("h", 2), value("w", 2), value("b", 1), value("x", 2)]
        return nodes, inputs, ["h2", "w2", "b2", "y", "saved"]
    nodes = [
        one,
        h.make_node("Add", ["dy", "dh"], ["dhs"]),
        h.make_node("Split", ["saved"], ["r", "z", "n", "hn"], axis=1, num_outputs=4),
        h.make_node("Sub", ["hp", "n"], ["hpn"]),
        h.make_node("Mul", ["dhs", "hpn"], ["dz0"]),
        h.make_node("Sub", ["one", "z"], ["omz"]),
        h.make_node("Mul", ["dhs", "omz"], ["dn0"]),
        h.make_node("Mul", ["n", "n"], ["n2"]),
        h.make_node("Sub", ["one", "n2"], ["omn2"]),
        h.make_node("Mul", ["dn0", "omn2"], ["dn"]),
        h.make_node("Mul", ["dn", "hn"], ["dr0"]),
        h.make_node("Sub", ["one", "r"], ["omr"]),
        h.make_node("Mul", ["r", "omr"], ["rs"]),
        h.make_node("Mul", ["dr0", "rs"], ["dr"]),
        h.make_node("Mul", ["z", "omz"], ["zs"]),
        h.make_node("Mul", ["dz0", "zs"], ["dz"]),
        h.make_node("Mul", ["dn", "r"], ["dnr"]),
        h.make_node("Concat", ["dr", "dz", "dn"], ["dx"], axis=1),
        h.make_node("Concat", ["dr", "dz", "dnr"], ["dgh"], axis=1),
        h.make_node("Mul", ["dhs", "z"], ["dhz"]),
        h.make_node("MatMul", ["dgh", "w"], ["dhw"]),
        h.make_node("Add", ["dhz", "dhw"], ["dh_prev"]),
        h.make_node("Identity", ["w"], ["w2"]),
    ]
    inputs = [value("dh", 2), value("w", 2), value("dy", 2), value("saved", 2), value("hp", 2)]
    return nodes, inputs, ["dh_prev", "w2", "dx", "dgh"]


def _scan(kind: str, states: list[Any], scanned: list[Any], results: int) -> list[Any]:
    """A Scan node of `kind`'s body in the node being translated; the values of its last
    `results` outputs (its scanned outputs), the states' final values named but unused."""
    import onnx_ir as ir
    from torch.onnx._internal.exporter import _core

    tracer = _core.current_tracer
    assert tracer is not None, "called outside the exporter's translation of a node"
    elem = int(scanned[0].dtype.value)
    backward = kind.endswith("backward")
    attributes = [
        ir.AttrGraph("body", _body(kind, elem)),
        ir.AttrInt64("num_scan_inputs", len(scanned)),
    ]
    if backward:
        attributes.append(ir.AttrInt64s("scan_input_directions", [1] * len(scanned)))
        attributes.append(ir.AttrInt64s("scan_output_directions", [1] * results))
    node = ir.Node(
        "",
        "Scan",
        [*states, *scanned],
        attributes=attributes,
        num_outputs=len(states) + results,
        version=16,
        name=f"{kind}_scan_{next(_names)}",
    )
    for k, output in enumerate(node.outputs):
        output.name = f"{node.name}_out{k}"
    tracer.nodes.append(node)
    return list(node.outputs)


def lower_lstm_scan(xp: Any, h0: Any, c0: Any, w_hh: Any) -> Any:
    _, _, _, y, c, gates = _scan("lstm_forward", [h0, c0, w_hh], [xp], 3)
    return y, c, gates


def lower_lstm_scan_backward(
    d_y: Any, d_c: Any, gates: Any, c: Any, c_prev: Any, dh: Any, dc: Any, w_hh: Any
) -> Any:
    dh0, dc0, _, d_gates = _scan("lstm_backward", [dh, dc, w_hh], [d_y, d_c, gates, c, c_prev], 1)
    return d_gates, dh0, dc0


def lower_gru_scan(xp: Any, h0: Any, w_hh: Any, b_hh: Any) -> Any:
    _, _, _, y, saved = _scan("gru_forward", [h0, w_hh, b_hh], [xp], 2)
    return y, saved


def lower_gru_scan_backward(d_y: Any, saved: Any, h_prev: Any, dh: Any, w_hh: Any) -> Any:
    dh0, _, d_xp, d_gh = _scan("gru_backward", [dh, w_hh], [d_y, saved, h_prev], 2)
    return d_xp, d_gh, dh0


#: our operators and their ONNX translations (`lowering.registry_for`)
TRANSLATIONS: dict[Any, Any] = {
    torch.ops.ort_autopatch.lstm_scan.default: lower_lstm_scan,
    torch.ops.ort_autopatch.lstm_scan_backward.default: lower_lstm_scan_backward,
    torch.ops.ort_autopatch.gru_scan.default: lower_gru_scan,
    torch.ops.ort_autopatch.gru_scan_backward.default: lower_gru_scan_backward,
}
