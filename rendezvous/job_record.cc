#include "rendezvous/job_record.h"

#include <utility>

#include "base/strings.h"

namespace launch::rendezvous {

std::string EncodeJobRecord(const JobRecord& r) {
  Fields f = ToFields(r.spec);
  f["job_spec_origin"] = r.spec_origin;
  f["job_round"] = std::to_string(r.round);
  f["job_restarts_used"] = std::to_string(r.restarts_used);
  f["job_generation"] = std::to_string(r.generation);
  f["job_num_nodes"] = std::to_string(r.num_nodes);
  return EncodeFields(f);
}

StatusOr<JobRecord> DecodeJobRecord(std::string_view text) {
  StatusOr<Fields> fields = DecodeFields(text);
  if (!fields.ok()) return Status::ProtocolError("job record: " + fields.status().message());
  StatusOr<JoinRequest> spec = ParseJoin(*fields);
  if (!spec.ok()) return Status::ProtocolError("job record: " + spec.status().message());
  JobRecord r;
  r.spec = *spec;
  auto origin = fields->find("job_spec_origin");
  if (origin == fields->end()) return Status::ProtocolError("job record: no 'job_spec_origin'");
  r.spec_origin = origin->second;
  for (auto [key, out] : {std::pair<const char*, int*>{"job_round", &r.round},
                          {"job_restarts_used", &r.restarts_used},
                          {"job_generation", &r.generation},
                          {"job_num_nodes", &r.num_nodes}}) {
    auto it = fields->find(key);
    long long v = 0;
    if (it == fields->end() || !ParseInt64(it->second, &v) || v < 0 || v > (1 << 30))
      return Status::ProtocolError(std::string("job record: field '") + key +
                                   "' missing or not a count");
    *out = static_cast<int>(v);
  }
  return r;
}

}  // namespace launch::rendezvous
