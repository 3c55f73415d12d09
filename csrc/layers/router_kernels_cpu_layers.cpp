// The CPU router kernels, compiled again for verl_ops._C_layers (see router_ops_layers.cpp).
#include "../cpu/router_kernels.cpp"
