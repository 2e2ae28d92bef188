// The test-only Python module flce_cuda_host: the CUDA binding (csrc/cuda/*.cpp, built
// with FLCE_CUDA_HOST) serving CPU tensors under the namespace flce_cuda_host, whose schemas are
// flce's (ops_def.h). Its kernels are the unchanged csrc/cuda/*.cu, compiled as host C++ and run
// by the host SIMT runtime (tools/cuda_host/host/). tests/cuda_emulation.py builds and loads it.
#include <Python.h>
#include <torch/library.h>

#include "ops_def.h"

TORCH_LIBRARY(flce_cuda_host, m) { flce::define_ops(m); }

extern "C" PyObject* PyInit_flce_cuda_host(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "flce_cuda_host", nullptr, -1,
                                          nullptr};
  return PyModule_Create(&module_def);
}
