// The pipeline-shared mark (shardopt/pipeline_runner.hpp), kept on the tensor like the split
// records (parallel/tensor_registry.hpp).
#include "parallel/tensor_registry.hpp"
#include "shardopt/error.hpp"
#include "shardopt/pipeline_runner.hpp"

namespace shardopt {
namespace {

struct PipelineShared {};

detail::TensorRegistry<PipelineShared>& shared_marks() {
  // Never destroyed: parameters may outlive static teardown.
  static auto* r = new detail::TensorRegistry<PipelineShared>();
  return *r;
}

}  // namespace

void mark_pipeline_shared(const at::Tensor& param) {
  SHARDOPT_CHECK(param.defined(), InvalidArgument,
                 "pipeline: mark_pipeline_shared: the tensor is undefined");
  shared_marks().put(param, PipelineShared{});
}

bool is_pipeline_shared(const at::Tensor& param) { return shared_marks().get(param).has_value(); }

}  // namespace shardopt
