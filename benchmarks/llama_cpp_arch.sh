# Sourced by setup_llama_cpp.sh and setup_llama_cpp_tools.sh: sets ARCH, the CMake flags that pick
# llama.cpp's CPU kernels, so the llama-cpp-python peer and the llama.cpp tools run the same code.
# Native by default (AVX2 or AVX-512 kernels, whichever the machine has). LLAMA_CPP_ISA=v3 builds
# the AVX2 kernels only (GGML_NATIVE off), the peer of pagedllm's AVX2 build (PAGEDLLM_CPU_ISA=v3).
#
# On a CPU with AMX (Intel Sapphire Rapids and later), -march=native also compiles llama.cpp's AMX
# backend, whose matmul segfaults on the first llama_decode on our VMs (llama.cpp#20824, open:
# both Q8_0 and Q4_K_M files; AMX itself works here). There the build names the AVX-512 levels
# one by one instead: the same kernels and weight repacking, without the AMX buffer type.
ARCH="-DGGML_NATIVE=ON"
if [ "${LLAMA_CPP_ISA:-native}" = v3 ]; then
    ARCH="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
elif grep -qw amx_int8 /proc/cpuinfo; then
    ARCH="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
fi
