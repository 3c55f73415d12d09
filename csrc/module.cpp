// Python entry point of verl_ops._C. The ops live in the torch.ops.verl_ops namespace
// (registration.cpp); importing this module only loads the library so they get registered.
#include <Python.h>

extern "C" {
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr,
                                          nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}
}
