// Teacher-forced logits of llama.cpp on a given token sequence, for `taps bench --peer llamacpp`'s logit
// check. Built against llama.cpp's library by scripts/build_llamacpp.sh (optional tooling: never needed by
// tests or CI).
//
//   taps-llamacpp-logits MODEL.gguf THREADS TOKENS.txt OUT.f32 [--no-repack]
//
// TOKENS.txt: the prompt length P on the first line, then all L token ids (prompt, then continuation),
// whitespace-separated. The prompt goes through llama_decode as one batch (logits of its last row only), then
// every continuation token but the last as a batch of one: llama-completion's greedy path, fed the given
// tokens instead of its own. OUT.f32: float32 [L - P + 1, n_vocab], row j the logits after token P - 1 + j (the
// prediction of token P + j). Prints "n_vocab <V> rows <L - P + 1>" on stdout; exits non-zero with a message
// on stderr on any failure.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "llama.h"

namespace {

int fail(const std::string& why) {
  std::fprintf(stderr, "taps-llamacpp-logits: %s\n", why.c_str());
  return 1;
}

void quiet_log(ggml_log_level level, const char* text, void*) {
  if (level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

// One llama_decode of tokens[begin, end) at their own positions; the last row's logits requested.
bool decode_span(llama_context* ctx, const std::vector<llama_token>& tokens, int begin, int end) {
  llama_batch batch = llama_batch_init(end - begin, 0, 1);
  for (int i = begin; i < end; ++i) {
    const int k = i - begin;
    batch.token[k] = tokens[i];
    batch.pos[k] = i;
    batch.n_seq_id[k] = 1;
    batch.seq_id[k][0] = 0;
    batch.logits[k] = i == end - 1;
  }
  batch.n_tokens = end - begin;
  const int rc = llama_decode(ctx, batch);
  llama_batch_free(batch);
  return rc == 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5 || argc > 6 || (argc == 6 && std::strcmp(argv[5], "--no-repack") != 0)) {
    return fail("usage: taps-llamacpp-logits MODEL.gguf THREADS TOKENS.txt OUT.f32 [--no-repack]");
  }
  const int threads = std::atoi(argv[2]);
  if (threads < 1) return fail(std::string("THREADS: expected an integer >= 1, received ") + argv[2]);
  std::ifstream in(argv[3]);
  int prompt_len = 0;
  if (!(in >> prompt_len)) return fail(std::string("TOKENS: no prompt length on the first line of ") + argv[3]);
  std::vector<llama_token> tokens;
  for (long long t; in >> t;) tokens.push_back(static_cast<llama_token>(t));
  const int L = static_cast<int>(tokens.size());
  if (prompt_len < 1 || prompt_len > L) {
    return fail("TOKENS: prompt length " + std::to_string(prompt_len) + " outside [1, " + std::to_string(L) + "]");
  }

  llama_log_set(quiet_log, nullptr);
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.use_extra_bufts = argc < 6;  // --no-repack: no repacked weight buffers (as llama-completion --no-repack)
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (model == nullptr) return fail(std::string("could not load ") + argv[1]);
  const llama_vocab* vocab = llama_model_get_vocab(model);
  const int V = llama_vocab_n_tokens(vocab);
  for (llama_token t : tokens) {
    if (t < 0 || t >= V) return fail("TOKENS: token " + std::to_string(t) + " outside the vocabulary");
  }
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = static_cast<uint32_t>(L + 16);
  cp.n_threads = threads;
  cp.n_threads_batch = threads;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (ctx == nullptr) return fail("could not create a context");

  std::FILE* out = std::fopen(argv[4], "wb");
  if (out == nullptr) return fail(std::string("could not open ") + argv[4]);
  bool ok = true;
  for (int end = prompt_len; ok && end <= L; ++end) {
    // the prompt as one batch, then each given token alone
    ok = decode_span(ctx, tokens, end == prompt_len ? 0 : end - 1, end);
    const float* logits = ok ? llama_get_logits_ith(ctx, -1) : nullptr;
    ok = logits != nullptr && std::fwrite(logits, sizeof(float), V, out) == static_cast<size_t>(V);
  }
  ok = std::fclose(out) == 0 && ok;
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  if (!ok) return fail("llama_decode or the output write failed");
  std::printf("n_vocab %d rows %d\n", V, L - prompt_len + 1);
  return 0;
}
