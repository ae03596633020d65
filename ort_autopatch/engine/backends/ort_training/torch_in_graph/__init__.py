"""Torch inside ONNX Runtime graphs: operators ORT cannot run (or runs slowly) stay in the graph
as nodes that call torch. Training-build only (`PythonOp` and ORT's `ATen` node exist there).

- `routing.py`: which ATen operators are sent to torch, and the export symbolics that emit
  their nodes (a new torch-calling operator: `routing.default_routes` for one always sent,
  else it is sent when ORT cannot export or differentiate it).
- `nodes.py`: the nodes at run time: their specs, the runners ORT calls, the contexts kept for
  backward, and the inventory of such nodes in a graph (the report's `torch_nodes`).
- `gradients.py`: ORT's slow CPU gradient kernels swapped for torch-calling nodes when a
  session is made (a new swapped gradient: `gradients.GRADIENTS_IN_TORCH`).
- `aten_executor.py` (+ `aten_executor.cpp`): the compiled executor that runs ORT's `ATen`
  nodes through torch's dispatcher, built once per torch version.
"""
