// What dtrt's kernels share: reading an input through the C API, and the ops register.cc registers.

#pragma once

#include "ort_abi.h"

#include <climits>
#include <vector>

namespace dtrt_ort {

// an input's data and shape, read through the C API (nullptr status: it worked)
struct Tensor {
  const void* data = nullptr;
  std::vector<int64_t> shape;
};

inline Status* read_input(const Calls& ort, KernelContext* ctx, size_t i, Tensor* t) {
  const Value* v = nullptr;
  ShapeInfo* info = nullptr;
  size_t rank = 0;
  void* data = nullptr;
  Status* s = ort.input(ctx, i, &v);
  if (!s) s = ort.data(v, &data);
  if (!s) s = ort.shape_info(v, &info);
  if (!s) s = ort.rank(info, &rank);
  if (!s) {
    t->shape.resize(rank);
    s = ort.dims(info, t->shape.data(), rank);
  }
  if (info) ort.release(info);
  t->data = data;
  return s;
}

// an op of the CPU provider whose kernel is a K (made by the caller's CreateKernelV2; its Compute(ctx) runs a
// call): required inputs, one fp32 output, every opset version; the caller sets the name, the inputs and the
// kernel's creation
template <typename K>
CustomOp cpu_op() {
  CustomOp op{};
  op.version = kApiVersion;
  op.GetExecutionProviderType = [](const CustomOp*) { return "CPUExecutionProvider"; };
  op.GetOutputType = [](const CustomOp*, size_t) -> int { return kFloat; };
  op.GetOutputTypeCount = [](const CustomOp*) -> size_t { return 1; };
  op.KernelDestroy = [](void* k) { delete static_cast<K*>(k); };
  op.GetInputCharacteristic = [](const CustomOp*, size_t) { return kRequired; };
  op.GetOutputCharacteristic = [](const CustomOp*, size_t) { return kRequired; };
  op.GetInputMemoryType = [](const CustomOp*, size_t) { return kMemDefault; };
  op.GetVariadicInputMinArity = [](const CustomOp*) { return 1; };
  op.GetVariadicInputHomogeneity = [](const CustomOp*) { return 1; };
  op.GetVariadicOutputMinArity = [](const CustomOp*) { return 1; };
  op.GetVariadicOutputHomogeneity = [](const CustomOp*) { return 1; };
  op.KernelComputeV2 = [](void* k, KernelContext* ctx) { return static_cast<K*>(k)->Compute(ctx); };
  op.GetStartVersion = [](const CustomOp*) { return 1; };
  op.GetEndVersion = [](const CustomOp*) { return INT_MAX; };
  return op;
}

const CustomOp* tree_attention_op();   // tree_attention.cc
const CustomOp* block_matmul_op();     // block_matmul.cc
const CustomOp* block_matmul_min_op();  // block_matmul.cc

}  // namespace dtrt_ort
