// The executor behind ONNX Runtime's `org.pytorch.aten::ATen` node: it calls a torch operator,
// found by name in torch's dispatcher, on ORT's tensors without a Python round trip.
//
// ORT hands every input as a DLPack tensor, non-tensor arguments included (0-d or 1-d
// constants); the operator's schema says how to read each one. Built on first use by
// aten_nodes.py against the torch in the running interpreter, and cached.
//
// ORT 1.19's executor interface (contrib_ops/cpu/aten_ops/aten_op_executor.h):
//   bool is_tensor_argument(op, overload, index, is_input)
//   void execute(op, overload, n_inputs, DLManagedTensor** inputs, n_outputs, outputs)

#include <ATen/ATen.h>
#include <ATen/DLConvertor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>

#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

enum class Kind { Tensor, Int, Float, Bool, Scalar, String, IntList, FloatList, BoolList };

struct Argument {
  Kind kind;
  bool optional;
  std::optional<c10::IValue> default_value;
};

struct Operator {
  c10::OperatorHandle handle;
  std::vector<Argument> arguments;
  std::vector<bool> tensor_returns;
};

Kind KindOf(const c10::TypePtr& type) {
  switch (type->kind()) {
    case c10::TypeKind::TensorType:
      return Kind::Tensor;
    case c10::TypeKind::IntType:
    case c10::TypeKind::SymIntType:
      return Kind::Int;
    case c10::TypeKind::FloatType:
      return Kind::Float;
    case c10::TypeKind::BoolType:
      return Kind::Bool;
    case c10::TypeKind::NumberType:
      return Kind::Scalar;
    case c10::TypeKind::StringType:
      return Kind::String;
    case c10::TypeKind::ListType: {
      auto element = type->castRaw<c10::ListType>()->getElementType()->kind();
      if (element == c10::TypeKind::IntType || element == c10::TypeKind::SymIntType) {
        return Kind::IntList;
      }
      if (element == c10::TypeKind::FloatType) return Kind::FloatList;
      if (element == c10::TypeKind::BoolType) return Kind::BoolList;
      break;
    }
    default:
      break;
  }
  TORCH_CHECK(false, "ort_autopatch ATen executor: no conversion for argument type ", type->str());
}

const Operator& Find(const char* name, const char* overload) {
  static std::mutex lock;
  static std::unordered_map<std::string, Operator> operators;
  std::string key = std::string(name) + "." + overload;
  std::lock_guard<std::mutex> guard(lock);
  auto found = operators.find(key);
  if (found != operators.end()) return found->second;
  std::string qualified = std::string(name).find("::") == std::string::npos
                              ? std::string("aten::") + name
                              : std::string(name);
  auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(qualified.c_str(), overload);
  Operator op{handle, {}, {}};
  for (const auto& argument : handle.schema().arguments()) {
    c10::TypePtr type = argument.type();
    bool optional = type->kind() == c10::TypeKind::OptionalType;
    if (optional) type = type->castRaw<c10::OptionalType>()->getElementType();
    op.arguments.push_back({KindOf(type), optional, argument.default_value()});
  }
  for (const auto& result : handle.schema().returns()) {
    op.tensor_returns.push_back(result.type()->kind() == c10::TypeKind::TensorType);
  }
  return operators.emplace(key, std::move(op)).first->second;
}

c10::IValue Read(const Argument& argument, DLManagedTensor* dlpack) {
  if (dlpack == nullptr) {
    if (argument.optional) return c10::IValue();
    if (argument.default_value) return *argument.default_value;
    return c10::IValue(at::Tensor());  // an absent gradient
  }
  // owns the DLPack from here on, whatever the argument's kind
  at::Tensor tensor = at::fromDLPack(dlpack);
  switch (argument.kind) {
    case Kind::Tensor:
      return tensor;
    case Kind::Int:
      return tensor.item<int64_t>();
    case Kind::Float:
      return tensor.item<double>();
    case Kind::Bool:
      return tensor.item<bool>();
    case Kind::Scalar:
      return tensor.item();
    case Kind::String: {  // its UTF-8 bytes, as uint8
      auto bytes = tensor.to(at::kByte).contiguous();
      const char* data = reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>());
      return std::string(data, data + bytes.numel());
    }
    case Kind::IntList: {
      auto values = tensor.to(at::kLong).contiguous();
      return c10::List<int64_t>(
          std::vector<int64_t>(values.data_ptr<int64_t>(), values.data_ptr<int64_t>() + values.numel()));
    }
    case Kind::FloatList: {
      auto values = tensor.to(at::kDouble).contiguous();
      return c10::List<double>(
          std::vector<double>(values.data_ptr<double>(), values.data_ptr<double>() + values.numel()));
    }
    case Kind::BoolList: {
      auto values = tensor.to(at::kBool).contiguous();
      c10::List<bool> list;
      for (int64_t k = 0; k < values.numel(); ++k) list.push_back(values.data_ptr<bool>()[k]);
      return list;
    }
  }
  return c10::IValue();
}

}  // namespace

extern "C" {

bool ort_autopatch_is_tensor_argument(const char* name, const char* overload, size_t index, bool is_input) {
  const Operator& op = Find(name, overload);
  if (is_input) {
    TORCH_CHECK(index < op.arguments.size(), name, " has ", op.arguments.size(), " arguments");
    return op.arguments[index].kind == Kind::Tensor;
  }
  TORCH_CHECK(index < op.tensor_returns.size(), name, " has ", op.tensor_returns.size(), " results");
  return op.tensor_returns[index];
}

void ort_autopatch_execute(const char* name, const char* overload, size_t input_count, DLManagedTensor** inputs,
                           size_t output_count, DLManagedTensor** outputs) {
  const Operator& op = Find(name, overload);
  TORCH_CHECK(input_count == op.arguments.size(), name, " takes ", op.arguments.size(), " arguments, the node has ",
              input_count);
  TORCH_CHECK(output_count <= op.tensor_returns.size(), name, " returns ", op.tensor_returns.size(),
              " values, the node has ", output_count);
  c10::InferenceMode inference;  // a graph node: ORT differentiates, not autograd
  torch::jit::Stack stack;
  stack.reserve(input_count);
  std::unordered_set<const void*> storages;  // ORT's buffers this call reads
  for (size_t k = 0; k < input_count; ++k) {
    stack.push_back(Read(op.arguments[k], inputs[k]));
    if (stack.back().isTensor() && stack.back().toTensor().defined()) {
      storages.insert(stack.back().toTensor().storage().data());
    }
  }
  op.handle.callBoxed(stack);
  for (size_t k = 0; k < output_count; ++k) {
    const c10::IValue& value = stack[k];
    at::Tensor result = value.isTensor() ? value.toTensor() : at::scalar_to_tensor(value.toScalar());
    if (!result.defined()) {
      outputs[k] = nullptr;
      continue;
    }
    // A result sharing an input's buffer (a view) is copied: ORT plans that buffer's reuse
    // once this node has consumed it, not knowing torch still points into it. (The gradient
    // operators routed here return new tensors; this guards any other operator.)
    if (!result.is_contiguous() || storages.count(result.storage().data()) != 0) {
      result = result.clone(at::MemoryFormat::Contiguous);
    }
    outputs[k] = at::toDLPack(result);
  }
}
}
