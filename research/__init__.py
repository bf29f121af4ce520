"""Research apart from serving: the from-scratch LMs (lms/), their trainers and the Neurocache trainer
(training/), and the evaluations of the served memories (evals/). It imports the engine; the engine
never imports it: the from-scratch LMs reach `longdoc serve` through the plugin in plugin.py.
"""
