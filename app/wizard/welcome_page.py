"""Wizard page 1: what MoE Ferry does and what set-up will ask."""

from __future__ import annotations

from PySide6.QtWidgets import QLabel, QVBoxLayout, QWizardPage

TEXT = """
<p>MoE Ferry runs <b>Mixtral-8x7B Instruct</b>, a 47-billion-parameter model, on a gaming PC,
fully offline. Its trick: the GPU keeps only the parts every word needs; the model's 256
<i>experts</i> wait in your computer's memory and are ferried to the GPU when a word calls
for them, with the most recently used ones kept close at hand.</p>
<p>This set-up takes a few steps:</p>
<ol>
<li>a look at your GPU, memory and disk, in plain words;</li>
<li>choosing the model (or a folder you already have, or the small demo model);</li>
<li>downloading and checking it; you can stop and continue later, even after a restart;</li>
<li>choosing how much GPU memory it may use.</li>
</ol>
<p>Nothing you type ever leaves this computer.</p>
"""


class WelcomePage(QWizardPage):
    def __init__(self, wizard):
        super().__init__()
        self.setTitle("Welcome to MoE Ferry")
        self.setSubTitle("Chat with Mixtral on your own GPU, offline.")
        label = QLabel(TEXT)
        label.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.addWidget(label)
        layout.addStretch(1)
