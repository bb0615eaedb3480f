// The library's entry point: ONNX Runtime's register_custom_ops_library calls RegisterCustomOps, which adds dtrt's
// kernels to the session under domain "dtrt", each under its function's name.

#include "kernels.h"

using namespace dtrt_ort;

extern "C" __attribute__((visibility("default"))) Status* RegisterCustomOps(SessionOptions* options,
                                                                           const ApiBase* base) {
  Api api = base->GetApi(kApiVersion);
  if (api == nullptr) return nullptr;  // an ONNX Runtime older than 1.21: nothing registered, the function body runs
  const Calls ort{api};
  static OpDomain* domain = nullptr;  // one per process, holding the ops, kept for the sessions' lifetime
  if (domain == nullptr) {
    OpDomain* made = nullptr;
    if (Status* s = ort.create_domain("dtrt", &made)) return s;
    for (const CustomOp* op : {tree_attention_op(), block_matmul_op(), block_matmul_min_op()})
      if (Status* s = ort.add_op(made, op)) return s;
    domain = made;
  }
  return ort.add_domain(options, domain);
}
