// router_ops.cpp compiled again for verl_ops._C_layers (stable ABI target 2.10): a separate
// object file, since the two libraries build the same source with different targets.
#include "../ops/router_ops.cpp"
