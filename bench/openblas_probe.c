/* openblas_probe: does a row of cblas_sgemm depend on M (the number of rows in the call) or on
 * the row's offset? Prints, per weight shape N x K, the M values whose rows differ bitwise from
 * the same rows computed in one 256-row call. Evidence for the batch-invariant kernel choice
 * (docs/benchmarks.md).  usage: openblas_probe [threads]   (try OPENBLAS_CORETYPE=Haswell) */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
char *openblas_get_corename(void);
static float rnd(void){ return (float)rand()/RAND_MAX - 0.5f; }
int main(int argc,char**argv){
  int threads = argc>1?atoi(argv[1]):2;
  openblas_set_num_threads(threads);
  int shapes[][2] = {{64,64},{172,64},{64,172},{512,64},{2048,768},{768,768},{768,2048},{32000,768},{96,64},{300,64},{1200,16},{16,16}};
  int Ms[] = {1,2,3,4,5,7,8,9,15,16,17,18,19,20,24,31,32,33,48,64,100,255,256};
  printf("core %s threads %d\n", openblas_get_corename(), threads);
  for (size_t s=0;s<sizeof shapes/sizeof shapes[0];s++){
    int N=shapes[s][0],K=shapes[s][1]; int MM=256;
    float *X=malloc(sizeof(float)*MM*K),*W=malloc(sizeof(float)*N*K),*Cref=malloc(sizeof(float)*MM*N),*C=malloc(sizeof(float)*MM*N);
    srand(1); for(int i=0;i<MM*K;i++)X[i]=rnd(); for(int i=0;i<N*K;i++)W[i]=rnd();
    cblas_sgemm(CblasRowMajor,CblasNoTrans,CblasTrans,MM,N,K,1,X,K,W,K,0,Cref,N);
    printf("N=%5d K=%5d differs at M:",N,K);
    for(size_t mi=0;mi<sizeof Ms/sizeof Ms[0];mi++){int M=Ms[mi];
      // rows starting at offset 37 to test position independence
      int off = (M+37<=MM)?37:0;
      cblas_sgemm(CblasRowMajor,CblasNoTrans,CblasTrans,M,N,K,1,X+off*K,K,W,K,0,C,N);
      if(memcmp(C,Cref+off*N,sizeof(float)*M*N)) printf(" %d",M);}
    printf("\n"); free(X);free(W);free(Cref);free(C);}
}
