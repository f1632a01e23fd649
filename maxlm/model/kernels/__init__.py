"""Hardware-specific kernels behind the model's plain JAX: cuDNN fused attention (cudnn.py),
fp8 matmuls with delayed scaling (fp8.py), and the tiled output-projection matmul (tiled_matmul.py).
Each has a reference path in plain JAX that the tests compare it with."""
