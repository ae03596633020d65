"""The training build's backend (`ort-training`: `onnxruntime-training` 1.19.2, CPython <= 3.11).

A call is exported with the TorchScript ONNX exporter (`export`, with the tool's extra
`symbolics`), the graph is fixed by declared passes (`passes`, over the functions of `graph`),
ORT's gradient builder differentiates it (`recipe_build` does these steps; `payload` is what
the persistent cache keeps of the result), and its TrainingAgent runs forward and backward
(`run`, `agent`). `backend.OrtTrainingBackend` is the engine's interface to all of it; on CPU
its sessions run a gradient graph with ORT's slow kernels swapped for torch-calling nodes
(`swap`, kept in the derived cache of `derived`). Operators ORT cannot export or differentiate
well run as torch-calling nodes (`torch_in_graph/`). `heap` prepares the process's heap while
the gradient builder's child runs.
"""
