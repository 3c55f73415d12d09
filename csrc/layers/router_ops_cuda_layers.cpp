// router_ops_cuda.cpp compiled again for verl_ops._C_layers (see router_ops_layers.cpp).
#include "../ops/router_ops_cuda.cpp"
