"""Multi-LoRA serving (docs/lora.md): adapters read from PEFT folders
(``adapter.py``), a device pool of ``--max-loras-per-batch`` slots and the
per-batch segments with their torch path (``pool.py``), the manager that ties
them to a model's linear layers (``manager.py``), and the scheduler's table
of which adapter holds which slot (``slots.py``)."""
