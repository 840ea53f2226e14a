// Token ids llama.cpp gives each text of a .inp file (texts separated by
// "\n__ggml_vocab_test__\n") with a vocab-only GGUF: one line of ids per text, no BOS, special
// tokens as text. Built and run by bench/peers/pre_vectors.py.
#include "llama.h"
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>
static void quiet(ggml_log_level, const char *, void *) {}
int main(int argc, char ** argv) {
    if (argc < 3) return 2;
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    auto mp = llama_model_default_params();
    mp.vocab_only = true;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    std::ifstream in(argv[2], std::ios::binary);
    std::stringstream ss; ss << in.rdbuf();
    std::string all = ss.str(), sep = "\n__ggml_vocab_test__\n";
    size_t pos = 0;
    while (true) {
        size_t e = all.find(sep, pos);
        if (e == std::string::npos) break;
        std::string text = all.substr(pos, e - pos);
        pos = e + sep.size();
        std::vector<llama_token> toks(text.size() + 8);
        int n = llama_tokenize(vocab, text.data(), (int) text.size(), toks.data(), (int) toks.size(), false, false);
        if (n < 0) { fprintf(stderr, "too many\n"); return 1; }
        for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", toks[i]);
        printf("\n");
    }
    return 0;
}
