// The CUDA router kernels, compiled again for verl_ops._C_layers (see router_ops_layers.cpp).
#include "../cuda/router_kernels.cu"
