"""TensorRT path for the ``specfoundry::TreeAttention`` op: Triton kernel, AOT PTX, QDP plugin, engines.

Modules (import what you need; none imports TensorRT at import time):

- ``kernel``    the fused Triton kernel, its launcher and the PyTorch reference (CPU-testable with
                ``TRITON_INTERPRET=1``).
- ``aot``       AOT compilation to PTX/cubin for sm_80 / sm_90 without a GPU, with the entry ABI.
- ``plugin``    the TensorRT Quickly Deployable Plugin (``register_plugin()``; JIT and AOT impls) and
                the pure launch-argument functions the ABI tests check.
- ``engine``    ``build_engines(onnx_dir, out_dir, profiles=...)``; ``EngineUnavailable`` without
                TensorRT or a GPU.
- ``gpu_check`` the prepared GPU check behind ``make gpu-check``.
"""
