// `launch`: the library plus main().
#include "launcher/launcher.h"

int main(int argc, char** argv) { return launch::launcher::Main(argc, argv); }
