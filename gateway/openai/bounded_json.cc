#include "tandem/gateway/bounded_json.h"

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

namespace tandem::gateway {
namespace {

using Json = nlohmann::ordered_json;

// nlohmann's SAX interface, building the document without recursion: a stack of the open
// containers, each object with the index of its keys.
class BoundedDomBuilder {
 public:
  explicit BoundedDomBuilder(const JsonLimits& limits) : limits_(limits) {}

  bool null() { return Put(nullptr) != nullptr; }
  bool boolean(bool v) { return Put(v) != nullptr; }
  bool number_integer(Json::number_integer_t v) { return Put(v) != nullptr; }
  bool number_unsigned(Json::number_unsigned_t v) { return Put(v) != nullptr; }
  bool number_float(Json::number_float_t v, const Json::string_t&) { return Put(v) != nullptr; }
  bool string(Json::string_t& v) { return Put(std::move(v)) != nullptr; }
  bool binary(Json::binary_t& v) { return Put(Json::binary(std::move(v))) != nullptr; }

  bool start_object(std::size_t) { return Open(Json::object()); }
  bool start_array(std::size_t) { return Open(Json::array()); }
  bool end_object() { return Close(); }
  bool end_array() { return Close(); }

  bool key(Json::string_t& k) {
    Frame& frame = open_.back();
    Json::object_t& object = frame.value->get_ref<Json::object_t&>();
    auto [at, added] = frame.keys.try_emplace(k, object.size());
    if (added) {
      if (object.size() >= limits_.max_object_keys) {
        error_ = absl::StrCat("an object has more than ", limits_.max_object_keys, " keys");
        return false;
      }
      // ordered_map's own insert searches its keys linearly; the index above replaces that.
      object.emplace_back(std::move(k), nullptr);
    }
    frame.next = &(object.begin() + static_cast<std::ptrdiff_t>(at->second))->second;
    return true;
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    error_ = absl::StrCat("the request body is not valid JSON: ", e.what());
    return false;
  }

  Json& root() { return root_; }
  const std::string& error() const { return error_; }

 private:
  struct Frame {
    Json* value;                                    // an open array or object
    absl::flat_hash_map<std::string, size_t> keys;  // object: key -> its position
    Json* next = nullptr;                           // object: the slot of the key just read
  };

  // Stores `v` where the document expects the next value; its address, or null on error.
  Json* Put(Json v) {
    if (open_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Frame& frame = open_.back();
    if (frame.value->is_array()) {
      Json::array_t& array = frame.value->get_ref<Json::array_t&>();
      array.push_back(std::move(v));
      return &array.back();
    }
    *frame.next = std::move(v);
    return frame.next;
  }

  bool Open(Json empty) {
    if (static_cast<int>(open_.size()) >= limits_.max_depth) {
      error_ = absl::StrCat("the request body is nested deeper than ", limits_.max_depth,
                            " arrays and objects");
      return false;
    }
    Json* slot = Put(std::move(empty));
    open_.push_back(Frame{slot, {}, nullptr});
    return true;
  }

  bool Close() {
    open_.pop_back();
    return true;
  }

  const JsonLimits& limits_;
  Json root_;
  std::vector<Frame> open_;
  std::string error_;
};

}  // namespace

absl::StatusOr<nlohmann::ordered_json> ParseBoundedJson(std::string_view text,
                                                        const JsonLimits& limits) {
  BoundedDomBuilder builder(limits);
  const bool parsed = Json::sax_parse(text.begin(), text.end(), &builder);
  if (!parsed) {
    return absl::InvalidArgumentError(builder.error().empty()
                                          ? std::string("the request body is not valid JSON")
                                          : builder.error());
  }
  return std::move(builder.root());
}

}  // namespace tandem::gateway
