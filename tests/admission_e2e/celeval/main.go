// celeval evaluates the chart's admission policy CEL with Kubernetes' own CEL
// environment (k8s.io/apiserver/pkg/cel/environment: the quantity, strings,
// lists and regex libraries a ValidatingAdmissionPolicy has), without an API
// server: tests/admission_e2e/test_cel_eval.py compares its messages with
// fracplugin explain's on the contract's table and on generated annotations.
//
// stdin: one JSON object per line {"prefix": CEL, "names": CEL, "problems": CEL, "pod": {...}};
// stdout: one JSON object per line {"problems": [[...], ...]} or {"error": "..."}.
// The variables are bound as the policy binds them (ann, names, prefix), in Go.
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"reflect"

	"github.com/google/cel-go/cel"
	"k8s.io/apimachinery/pkg/util/version"
	"k8s.io/apiserver/pkg/cel/environment"
)

var jsonListType = reflect.TypeOf([][]string{})

type request struct {
	Prefix   string         `json:"prefix"`
	Problems string         `json:"problems"`
	Names    string         `json:"names"`
	Pod      map[string]any `json:"pod"`
}

func main() {
	base := environment.MustBaseEnvSet(version.MajorMinor(1, 35))
	envs, err := base.Extend(environment.VersionedOptions{
		IntroducedVersion: version.MajorMinor(1, 0),
		EnvOptions: []cel.EnvOption{
			cel.Variable("object", cel.DynType),
			cel.Variable("variables", cel.MapType(cel.StringType, cel.DynType)),
		},
	})
	if err != nil {
		panic(err)
	}
	env, err := envs.Env(environment.StoredExpressions)
	if err != nil {
		panic(err)
	}
	programs := map[string]cel.Program{}
	compile := func(expr string) (cel.Program, error) {
		if p, ok := programs[expr]; ok {
			return p, nil
		}
		ast, iss := env.Compile(expr)
		if iss.Err() != nil {
			return nil, iss.Err()
		}
		p, err := env.Program(ast, cel.CostLimit(1000000))
		if err != nil {
			return nil, err
		}
		programs[expr] = p
		return p, nil
	}
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 64<<20)
	out := json.NewEncoder(os.Stdout)
	for in.Scan() {
		var req request
		if err := json.Unmarshal(in.Bytes(), &req); err != nil {
			out.Encode(map[string]string{"error": "bad request: " + err.Error()})
			continue
		}
		res, err := eval(compile, req)
		if err != nil {
			out.Encode(map[string]string{"error": err.Error()})
			continue
		}
		out.Encode(map[string]any{"problems": res})
	}
}

func eval(compile func(string) (cel.Program, error), req request) (any, error) {
	vars := map[string]any{}
	names := req.Names // the policy's own variables.names (admission.NAMES_EXPRESSION)
	if names == "" {
		names = "object.spec.containers.map(c, c.name)"
	}
	run := func(expr string) (any, error) {
		p, err := compile(expr)
		if err != nil {
			return nil, fmt.Errorf("compile: %w", err)
		}
		v, _, err := p.Eval(map[string]any{"object": req.Pod, "variables": vars})
		if err != nil {
			return nil, fmt.Errorf("eval: %w", err)
		}
		return v.Value(), nil
	}
	for _, kv := range [][2]string{
		{"prefix", req.Prefix},
		{"ann", "has(object.metadata.annotations) ? object.metadata.annotations : {'': ''}"},
		{"names", names},
	} {
		v, err := run(kv[1])
		if err != nil {
			return nil, fmt.Errorf("%s: %w", kv[0], err)
		}
		vars[kv[0]] = v
	}
	p, err := compile(req.Problems)
	if err != nil {
		return nil, fmt.Errorf("compile problems: %w", err)
	}
	v, _, err := p.Eval(map[string]any{"object": req.Pod, "variables": vars})
	if err != nil {
		return nil, fmt.Errorf("eval problems: %w", err)
	}
	native, err := v.ConvertToNative(jsonListType)
	if err != nil {
		return nil, err
	}
	return native, nil
}
