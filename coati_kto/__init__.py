"""coati-kto: KTO training on ColossalAI, from one CPU to many GPU nodes."""
