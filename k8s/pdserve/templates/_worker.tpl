{{/*
One worker pod template: `pdserve worker` serving one rank.
ctx: root, role, w (workers.<role>), group ("": standalone; "lws": LeaderWorkerSet; "<g>": StatefulSet group g), sts, svc.
A worker registers its --host as its endpoint in Redis, so it binds the pod IP (there is no
separate advertise flag); kubelet's probes and Prometheus reach the pod IP too.
*/}}
{{- define "pdserve.workerPod" -}}
{{- $root := .root }}
{{- $w := .w }}
{{- $group := ne .group "" }}
{{- $ctx := dict "root" $root "component" .role }}
{{- $resources := deepCopy $w.resources }}
{{- if gt (int $w.gpus) 0 }}
{{- $limits := default (dict) $resources.limits }}
{{- $_ := set $limits "nvidia.com/gpu" (int $w.gpus) }}
{{- $_ := set $resources "limits" $limits }}
{{- end -}}
metadata:
  labels:
    {{- include "pdserve.componentLabels" $ctx | nindent 4 }}
    {{- if and $group (ne .group "lws") }}
    pdserve.io/group: {{ .group | quote }}
    {{- end }}
  {{- with $w.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- include "pdserve.podCommon" $root | nindent 2 }}
  terminationGracePeriodSeconds: {{ add $w.preStopSleepSeconds $root.Values.drain.graceSeconds $root.Values.drain.marginSeconds }}
  {{- with include "pdserve.modelInit" $root }}
  {{- . | nindent 2 }}
  {{- end }}
  containers:
    - name: worker
      image: {{ include "pdserve.image" (dict "root" $root "image" $w.image) }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      command: [pdserve]
      args:
        - worker
        - --role
        - {{ .role }}
        - --model
        - {{ include "pdserve.modelPath" $root }}
        {{- with $root.Values.model.servedModelName }}
        - --served-model-name
        - {{ . | quote }}
        {{- end }}
        - --host
        - $(POD_IP)
        - --port
        - {{ $w.port | quote }}
        - --metrics-port
        - {{ $w.metricsPort | quote }}
        - --registry
        - {{ include "pdserve.registryUrl" $root | quote }}
        {{- if not $root.Values.auth.enabled }}
        # No internal token (auth.enabled=false): pdserve refuses a pod IP without this.
        - --insecure-internal
        {{- end }}
        - --grace-s
        - {{ $root.Values.drain.graceSeconds | quote }}
        - --kv-transport
        - {{ $root.Values.kvTransfer.transport }}
        {{- if not $root.Values.kvTransfer.checksum }}
        - --no-kv-checksum
        {{- end }}
        {{- if $root.Values.kvCache.prefault }}
        - --kv-prefault
        {{- end }}
        {{- if $group }}
        - --dp
        - "1"
        - --ep
        - {{ $w.ep | quote }}
        - --dp-rank-offset
        - $(POD_INDEX)
        - --dist-master-addr
        {{- if eq .group "lws" }}
        - $(LWS_LEADER_ADDRESS)
        {{- else }}
        - {{ printf "%s-0.%s" .sts .svc }}
        {{- end }}
        - --dist-master-port
        - {{ $w.distMasterPort | quote }}
        {{- end }}
        {{- range $w.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      ports:
        - name: grpc
          containerPort: {{ $w.port }}
          protocol: TCP
        - name: metrics
          containerPort: {{ $w.metricsPort }}
          protocol: TCP
        {{- if $group }}
        - name: dist
          containerPort: {{ $w.distMasterPort }}
          protocol: TCP
        {{- end }}
      env:
        - name: POD_IP
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        {{- if $group }}
        - name: POD_INDEX
          valueFrom:
            fieldRef:
              {{- if eq .group "lws" }}
              fieldPath: metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']
              {{- else }}
              fieldPath: metadata.labels['apps.kubernetes.io/pod-index']
              {{- end }}
        {{- end }}
        {{- include "pdserve.commonEnv" (dict "root" $root "container" "worker") | nindent 8 }}
        {{- range $name, $value := $root.Values.kvTransfer.ucx }}
        - name: {{ $name }}
          value: {{ $value | quote }}
        {{- end }}
        {{- with $w.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- include "pdserve.probes" (dict "root" $root "port" $w.port) | nindent 6 }}
      lifecycle:
        {{- include "pdserve.preStop" $w.preStopSleepSeconds | nindent 8 }}
      resources:
        {{- toYaml $resources | nindent 8 }}
      securityContext:
        {{- toYaml $root.Values.securityContext | nindent 8 }}
      volumeMounts:
        {{- include "pdserve.modelMounts" $root | nindent 8 }}
        - name: shm
          mountPath: /dev/shm
  volumes:
    {{- include "pdserve.modelVolume" $root | nindent 4 }}
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $w.shmSize }}
  {{- with include "pdserve.scheduling" $w }}
  {{- . | nindent 2 }}
  {{- end }}
{{- end }}
