// The part of ONNX Runtime's C ABI that dtrt's kernels use, declared here so that they build with a C++ compiler
// alone: the onnxruntime Python wheel ships the library but no headers. The ABI only grows: a function's place in
// the OrtApi table, the layout of OrtCustomOp and the enum values below never change once released, and a library
// that asks GetApi for API version 21 (ONNX Runtime 1.21) gets the same table from every later release.
// tests/test_ort_ops.py compiles a check of every entry against ONNX Runtime's own header where one is at hand.

#pragma once

#include <cstddef>
#include <cstdint>

namespace dtrt_ort {

constexpr uint32_t kApiVersion = 21;

struct Status;
struct Value;
struct KernelContext;
struct KernelInfo;
struct ShapeInfo;  // OrtTensorTypeAndShapeInfo
struct SessionOptions;
struct OpDomain;  // OrtCustomOpDomain

using Api = const void* const*;  // the OrtApi table: one function pointer per entry

// entries of the OrtApi table this library calls, by their place in it
enum Entry : size_t {
  kCreateStatus = 0,
  kCreateCustomOpDomain = 26,
  kCustomOpDomainAdd = 27,
  kAddCustomOpDomain = 28,
  kGetTensorMutableData = 51,
  kGetDimensionsCount = 61,
  kGetDimensions = 62,
  kGetTensorTypeAndShape = 65,
  kKernelContextGetInput = 90,
  kKernelInfoGetAttributeInt64 = 86,
  kKernelContextGetOutput = 91,
  kReleaseStatus = 93,
  kReleaseTensorTypeAndShapeInfo = 99,
  // since ONNX Runtime 1.17 (API version 17), so within kApiVersion's table
  kKernelContextParallelFor = 274,
};

enum ElementType : int { kFloat = 1, kUInt8 = 2, kInt64 = 7, kBool = 9 };  // ONNXTensorElementDataType
enum ErrorCode : int { kInvalidArgument = 2 };                  // OrtErrorCode
constexpr int kRequired = 0;                                    // INPUT_OUTPUT_REQUIRED
constexpr int kMemDefault = 0;                                  // OrtMemTypeDefault

struct ApiBase {  // OrtApiBase
  Api (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

struct CustomOp {  // OrtCustomOp as of API version 21: every field, in order
  uint32_t version;
  void* (*CreateKernel)(const CustomOp*, Api, const KernelInfo*);
  const char* (*GetName)(const CustomOp*);
  const char* (*GetExecutionProviderType)(const CustomOp*);
  int (*GetInputType)(const CustomOp*, size_t);
  size_t (*GetInputTypeCount)(const CustomOp*);
  int (*GetOutputType)(const CustomOp*, size_t);
  size_t (*GetOutputTypeCount)(const CustomOp*);
  void (*KernelCompute)(void*, KernelContext*);
  void (*KernelDestroy)(void*);
  int (*GetInputCharacteristic)(const CustomOp*, size_t);
  int (*GetOutputCharacteristic)(const CustomOp*, size_t);
  int (*GetInputMemoryType)(const CustomOp*, size_t);
  int (*GetVariadicInputMinArity)(const CustomOp*);
  int (*GetVariadicInputHomogeneity)(const CustomOp*);
  int (*GetVariadicOutputMinArity)(const CustomOp*);
  int (*GetVariadicOutputHomogeneity)(const CustomOp*);
  Status* (*CreateKernelV2)(const CustomOp*, Api, const KernelInfo*, void**);
  Status* (*KernelComputeV2)(void*, KernelContext*);
  Status* (*InferOutputShapeFn)(const CustomOp*, void*);
  int (*GetStartVersion)(const CustomOp*);
  int (*GetEndVersion)(const CustomOp*);
  size_t (*GetMayInplace)(int**, int**);
  void (*ReleaseMayInplace)(int*, int*);
  size_t (*GetAliasMap)(int**, int**);
  void (*ReleaseAliasMap)(int*, int*);
};

// the calls, typed as the C API declares them (every Status* result: nullptr on success)
struct Calls {
  Api api;

  template <typename F>
  F at(Entry e) const {
    return reinterpret_cast<F>(api[e]);
  }
  Status* error(ErrorCode code, const char* message) const {
    return at<Status* (*)(int, const char*)>(kCreateStatus)(code, message);
  }
  Status* create_domain(const char* name, OpDomain** out) const {
    return at<Status* (*)(const char*, OpDomain**)>(kCreateCustomOpDomain)(name, out);
  }
  Status* add_op(OpDomain* domain, const CustomOp* op) const {
    return at<Status* (*)(OpDomain*, const CustomOp*)>(kCustomOpDomainAdd)(domain, op);
  }
  Status* add_domain(SessionOptions* options, OpDomain* domain) const {
    return at<Status* (*)(SessionOptions*, OpDomain*)>(kAddCustomOpDomain)(options, domain);
  }
  Status* input(const KernelContext* ctx, size_t i, const Value** out) const {
    return at<Status* (*)(const KernelContext*, size_t, const Value**)>(kKernelContextGetInput)(ctx, i, out);
  }
  Status* output(KernelContext* ctx, size_t i, const int64_t* dims, size_t rank, Value** out) const {
    using F = Status* (*)(KernelContext*, size_t, const int64_t*, size_t, Value**);
    return at<F>(kKernelContextGetOutput)(ctx, i, dims, rank, out);
  }
  Status* data(const Value* v, void** out) const {
    // GetTensorMutableData takes a non-const OrtValue*; the inputs are only read
    return at<Status* (*)(Value*, void**)>(kGetTensorMutableData)(const_cast<Value*>(v), out);
  }
  Status* shape_info(const Value* v, ShapeInfo** out) const {
    return at<Status* (*)(const Value*, ShapeInfo**)>(kGetTensorTypeAndShape)(v, out);
  }
  Status* rank(const ShapeInfo* info, size_t* out) const {
    return at<Status* (*)(const ShapeInfo*, size_t*)>(kGetDimensionsCount)(info, out);
  }
  Status* dims(const ShapeInfo* info, int64_t* out, size_t n) const {
    return at<Status* (*)(const ShapeInfo*, int64_t*, size_t)>(kGetDimensions)(info, out, n);
  }
  void release(ShapeInfo* info) const { at<void (*)(ShapeInfo*)>(kReleaseTensorTypeAndShapeInfo)(info); }
  void release(Status* status) const { at<void (*)(Status*)>(kReleaseStatus)(status); }
  Status* attribute(const KernelInfo* info, const char* name, int64_t* out) const {
    return at<Status* (*)(const KernelInfo*, const char*, int64_t*)>(kKernelInfoGetAttributeInt64)(info, name, out);
  }
  // fn(data, i) for i in [0, total) on the session's intra-op thread pool (in the calling thread without one),
  // returning when all have run; batches: at most that many batches of consecutive i (0: ONNX Runtime's choice)
  Status* parallel_for(const KernelContext* ctx, void (*fn)(void*, size_t), size_t total, size_t batches,
                       void* data) const {
    using F = Status* (*)(const KernelContext*, void (*)(void*, size_t), size_t, size_t, void*);
    return at<F>(kKernelContextParallelFor)(ctx, fn, total, batches, data);
  }
};

}  // namespace dtrt_ort
