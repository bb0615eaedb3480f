// What dtrt's kernels share: reading an input through the C API, and the ops register.cc registers.

#pragma once

#include "ort_abi.h"

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

const CustomOp* tree_attention_op();   // tree_attention.cc
const CustomOp* block_matmul_op();     // block_matmul.cc
const CustomOp* block_matmul_min_op();  // block_matmul.cc

}  // namespace dtrt_ort
