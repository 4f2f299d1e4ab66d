from pipeline.tools.gpu_smoke import main

main()
