"""Triton models the tests start a real tritonserver with."""

# y = x: a Python-backend model, the one kind the bundled tritonserver can run (nvidia-pytriton's)
ECHO_MODEL = {
    "config.pbtxt": 'backend: "python"\nmax_batch_size: 0\n'
                    'input [{ name: "x", data_type: TYPE_FP32, dims: [ 1 ] }]\n'
                    'output [{ name: "y", data_type: TYPE_FP32, dims: [ 1 ] }]\n',
    "1/model.py": "import triton_python_backend_utils as pb\n\n\nclass TritonPythonModel:\n"
                  "    def execute(self, requests):\n"
                  "        return [pb.InferenceResponse([pb.Tensor('y', pb.get_input_tensor_by_name(r, 'x')\n"
                  "                                                           .as_numpy())]) for r in requests]\n",
}
